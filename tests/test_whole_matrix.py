"""Optimizers that read whole matrices, exact under sharding: torch's Muon (each matrix's momentum
orthogonalized by Newton-Schulz iterations) and a user's own optimizer declared whole-matrix are
stepped on whole matrices, each on one rank ([Note: whole-matrix placement]); against one process
on the global batch to 1e-5 (fp32), at world 2 and 3, with every sharding strategy, CPU offload,
accumulation, clipping, mixed precision and per-Linear or whole-model units. The Newton-Schulz
calls are counted: each matrix once in the world per step, spread over the ranks. Unknown
optimizers are measured (tests/test_optimizer_probe.py), torch's Adafactor is placed whole, LBFGS is
refused; a declaration wins over a measurement."""

from __future__ import annotations

import copy
import functools
import re
import warnings

import lightning as L
import lightning_utilities.core.rank_zero
import pytest
import torch
import torch.distributed as dist
from dist_utils import LogLines, run_ranks
from models import VOCAB, Block
from oracle import PrecisionOracle
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy, MixedPrecision
from fsdp_strategy.engine import get_scheduler, shard_model

DDP = "ddp_find_unused_parameters_true"  # Block has a layer that gets no gradient

MUON = getattr(torch.optim, "Muon", None)
pytestmark = pytest.mark.skipif(MUON is None, reason="torch.optim.Muon needs torch 2.9 or newer")


def _mlp() -> nn.Module:
    """The issue's model: three Linear layers without biases (every parameter a matrix)."""
    return nn.Sequential(
        nn.Linear(12, 20, bias=False), nn.ReLU(), nn.Linear(20, 17, bias=False), nn.ReLU(), nn.Linear(17, 5, bias=False)
    )


class FrobeniusScaled(torch.optim.Optimizer):
    """A user's own whole-matrix optimizer: each update is the gradient divided by its matrix's
    Frobenius norm (on a shard of rows that norm is another one), with a momentum buffer."""

    def __init__(self, params, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buffer = self.state[p].setdefault("buffer", torch.zeros_like(p))
                buffer.mul_(group["momentum"]).add_(p.grad)
                p.sub_(group["lr"] * buffer / buffer.norm().clamp(min=1e-12))
        return loss


def _batches(steps: int, world: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [[torch.randn(4, 12, generator=generator) for _ in range(world)] for _ in range(steps)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


class _Counted:
    """Counts calls of torch's Newton-Schulz iteration on this rank (the work each matrix costs)."""

    def __init__(self) -> None:
        import torch.optim._muon as muon

        self.module, self.original, self.calls = muon, muon._zeropower_via_newtonschulz, 0

        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        muon._zeropower_via_newtonschulz = counted

    def close(self) -> None:
        self.module._zeropower_via_newtonschulz = self.original


def _run(rank: int, world: int, case: dict, steps: int = 3) -> dict:
    """Train sharded and the one-process oracle side by side; the losses, the weights and the calls."""
    torch.manual_seed(0)
    model = _mlp()
    make = case.get("optimizer", lambda m: MUON(m.parameters(), lr=0.02))
    precision = case.get("precision")
    oracle = PrecisionOracle(copy.deepcopy(model), precision or "32-true", make)
    options = dict(case.get("shard", {}))
    if precision:
        options["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if options.get("sharding_strategy") == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh

        options["device_mesh"] = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    shard_model(model, **options)
    optimizer = make(model)
    accumulate, clip = case.get("accumulate", 1), case.get("clip")
    counter = _Counted()
    losses, ref_losses, calls = [], [], []
    try:
        for step, micro_batches in enumerate(_batches(steps * accumulate, world)):
            last = (step + 1) % accumulate == 0
            with get_scheduler(model).no_sync() if not last else torch.enable_grad():
                context = torch.autocast("cpu", dtype=torch.bfloat16) if precision else torch.enable_grad()
                with context:
                    loss = _loss(model, micro_batches[rank]) / accumulate
                loss.backward()
            ref = oracle.micro_batch(_loss, micro_batches, divide=accumulate)
            if not last:
                continue
            if clip:
                get_scheduler(model).clip_grad_norm_(clip)
            before = counter.calls
            optimizer.step()
            optimizer.zero_grad()
            calls.append(counter.calls - before)
            oracle.step(world, clip_norm=clip)
            losses.append(loss.item() * accumulate)
            ref_losses.append(ref[rank])
    finally:
        counter.close()
    from fsdp_strategy.checkpoint import full_state_dict

    got = full_state_dict(model, rank0_only=False)
    expected = oracle.master.state_dict()
    error = max(((got[k] - expected[k]).abs().max() / expected[k].abs().max()).item() for k in expected)
    total = torch.tensor(calls)
    dist.all_reduce(total)
    return {"losses": losses, "ref_losses": ref_losses, "weight_error": error, "calls": calls, "total": total.tolist()}


CASES = {
    "per-Linear units": {"shard": {"auto_wrap_policy": {nn.Linear}}},
    "whole model one unit": {},
    "SHARD_GRAD_OP": {"shard": {"sharding_strategy": "SHARD_GRAD_OP", "auto_wrap_policy": {nn.Linear}}},
    "HYBRID_SHARD": {"shard": {"sharding_strategy": "HYBRID_SHARD", "auto_wrap_policy": {nn.Linear}}},
    "CPU offload": {"shard": {"cpu_offload": True, "auto_wrap_policy": {nn.Linear}}},
    "accumulation and clipping": {"accumulate": 2, "clip": 0.5, "shard": {"auto_wrap_policy": {nn.Linear}}},
    "bf16 mixed (fp32 master)": {"precision": "bf16-mixed", "shard": {"auto_wrap_policy": {nn.Linear}}},
    "declared whole-matrix optimizer": {
        "optimizer": lambda m: FrobeniusScaled(m.parameters()),
        "shard": {"auto_wrap_policy": {nn.Linear}, "optimizer_updates": {FrobeniusScaled: "whole_matrix"}},
    },
}


def _cases_body(rank: int, world: int) -> dict:
    return {name: _run(rank, world, case) for name, case in CASES.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_whole_matrix_optimizers_equal_one_process_on_the_global_batch(tmp_path, world):
    results = run_ranks(_cases_body, world, tmp_path, timeout=300)
    for name in CASES:
        result = results[0][name]
        assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5), name
        assert result["weight_error"] < 1e-5, (name, result["weight_error"])
        if "declared" not in name:  # Muon: each of the 3 matrices orthogonalized once in the world per step
            assert result["total"] == [3, 3, 3], (name, result["total"])
            per_rank = [results[rank][name]["calls"][0] for rank in range(world)]
            assert max(per_rank) - min(per_rank) <= 1 + (3 % world == 0), (name, per_rank)  # spread over the ranks


def _refusals_body(rank: int, world: int) -> dict:
    messages = {}
    for name, make, updates in [
        ("lbfgs", lambda m: torch.optim.LBFGS(m.parameters()), None),
        ("adafactor", lambda m: torch.optim.Adafactor(m.parameters()), None),
        ("unknown", lambda m: FrobeniusScaled(m.parameters()), None),
        ("declared", lambda m: FrobeniusScaled(m.parameters()), {FrobeniusScaled: "elementwise"}),
    ]:
        model = shard_model(_mlp(), optimizer_updates=updates)
        optimizer = make(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for _ in range(2):
                    _loss(model, torch.randn(4, 12)).backward()
                    optimizer.step(closure=functools.partial(_loss, model, torch.randn(4, 12)))
                messages[name] = "stepped"
            except TypeError as error:
                messages[name] = str(error)
        messages[name + " warnings"] = [str(w.message) for w in caught if "fsdp_custom" in str(w.message)]
        get_scheduler(model).close()
    return messages


def test_known_declared_and_measured_optimizers(tmp_path):
    messages = run_ranks(_refusals_body, 2, tmp_path, timeout=120)[0]
    assert "LBFGS cannot step sharded parameters: it steps the whole parameter vector" in messages["lbfgs"]
    assert "sharding_strategy='NO_SHARD'" in messages["lbfgs"]
    assert messages["adafactor"] == "stepped" and messages["adafactor warnings"] == []  # torch's: placed whole
    assert messages["unknown"] == "stepped" and messages["unknown warnings"] == []  # measured: placed whole
    assert messages["declared"] == "stepped" and messages["declared warnings"] == []


class MuonMLP(L.LightningModule):
    """Muon on every matrix of the MLP, automatic optimization."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = _mlp()

    def training_step(self, batch, batch_idx):
        loss = _loss(self.net, batch[0])
        self.log("loss", loss)
        self.losses = [*getattr(self, "losses", []), loss.detach().clone()]
        return loss

    def configure_optimizers(self):
        return MUON(self.parameters(), lr=0.02)


class MuonBesideAdamW(MuonMLP):
    """Muon for the hidden matrices, AdamW for embeddings, head and 1-D parameters (what Muon's
    authors recommend): two optimizers under manual optimization."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 12)
        self.blocks = nn.Sequential(Block(12), Block(12))
        self.head = nn.Linear(12, VOCAB)
        self.automatic_optimization = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))

    def training_step(self, batch, batch_idx):
        muon, adamw = self.optimizers()
        tokens = batch[0]
        loss = nn.functional.cross_entropy(self(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        self.manual_backward(loss)
        for optimizer in (muon, adamw):
            optimizer.step()
            optimizer.zero_grad()
        self.losses = [*getattr(self, "losses", []), loss.detach().clone()]

    def configure_optimizers(self):
        hidden = [p for n, p in self.blocks.named_parameters() if p.ndim == 2]
        rest = [p for p in self.parameters() if all(p is not h for h in hidden)]
        return [MUON(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


class OneOptimizer(MuonBesideAdamW):
    """Muon beside AdamW as one optimizer (``MuonWithAdamW``): automatic optimization, one step count."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        loss = nn.functional.cross_entropy(self(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        self.losses = [*getattr(self, "losses", []), loss.detach().clone()]
        return loss

    def configure_optimizers(self):
        from fsdp_strategy import MuonWithAdamW

        hidden = [p for p in self.blocks.parameters() if p.ndim == 2]
        rest = [p for p in self.parameters() if all(p is not h for h in hidden)]
        return MuonWithAdamW(hidden, rest, muon={"lr": 0.02}, adamw={"lr": 1e-2})


def _lightning_body(rank: int, world: int, root: str) -> dict:
    from models import make_batches

    results = {}
    for name, module_class, data in [
        ("muon", MuonMLP, torch.randn(6 * 2 * world, 12, generator=torch.Generator().manual_seed(1))),
        ("muon+adamw", MuonBesideAdamW, make_batches(6, 2 * world).reshape(6 * 2 * world, -1)),
        ("MuonWithAdamW", OneOptimizer, make_batches(6, 2 * world).reshape(6 * 2 * world, -1)),
    ]:
        for strategy in ("fsdp", "ddp"):
            module = module_class()
            chosen = FSDPCustomStrategy(auto_wrap_policy={nn.Linear, Block}) if strategy == "fsdp" else DDP
            trainer = quiet_trainer(strategy=chosen, devices=world, max_steps=6, default_root_dir=root)
            told = LogLines()
            lightning_utilities.core.rank_zero.log.addHandler(told)  # where Lightning's rank_zero_info writes
            try:
                trainer.fit(module, DataLoader(TensorDataset(data), batch_size=2))
            finally:
                lightning_utilities.core.rank_zero.log.removeHandler(told)
            losses = torch.stack(module.losses)
            dist.all_reduce(losses)
            results[name, strategy] = (losses / world).tolist()
            results[name, strategy, "placed"] = [line for line in told.lines if "whole on one rank" in line]
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_muon_in_lightning_equals_ddp(tmp_path, world):
    results = run_ranks(_lightning_body, world, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    # DDP divides gradients before its all-reduce, the engine after its reduce-scatter: the last bit of a
    # gradient can differ, and Muon's Newton-Schulz iterations run in bf16 (against one process on the
    # global batch the engine is exact: test_whole_matrix_optimizers_equal_one_process_on_the_global_batch)
    for name in ("muon", "muon+adamw", "MuonWithAdamW"):
        assert results[name, "fsdp"] == pytest.approx(results[name, "ddp"], rel=1e-4), name
    assert len(results["MuonWithAdamW", "fsdp"]) == 6  # one optimizer: one step counted per batch
    # after its first step, once, rank 0 says how Muon places the matrices (the Linear layers' weights)
    for name in ("muon", "muon+adamw"):
        (placed,) = results[name, "fsdp", "placed"]
        assert placed.startswith("fsdp_custom: Muon steps each of its "), placed
        count = int(placed.split("each of its ")[1].split()[0])
        shares = [int(n) for n in re.findall(r"rank \d+ (\d+) \(", placed)]
        assert f"whole on one rank of the {world} that shard it" in placed and sum(shares) == count, placed
    assert results["muon", "ddp", "placed"] == []


def _resume_body(rank: int, world: int, root: str, kind: str, ckpt: str | None) -> list[float]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = torch.randn(48, 12, generator=torch.Generator().manual_seed(1))
    module = MuonMLP()
    checkpoint = ModelCheckpoint(dirpath=f"{root}/{kind}", every_n_train_steps=3, save_top_k=-1)
    strategy = FSDPCustomStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=kind)
    trainer = quiet_trainer(
        strategy=strategy, devices=world, max_steps=6, callbacks=[checkpoint], enable_checkpointing=True
    )
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=12 // world), ckpt_path=ckpt)
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    return (losses / world).tolist()


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_muon_state_resumes_exactly_at_another_world_size_and_consolidates(tmp_path, kind):
    root = str(tmp_path)
    straight = run_ranks(_resume_body, 2, tmp_path, root, kind, None, env=LIGHTNING_ENV, timeout=300)[0]
    saved = f"{root}/{kind}/epoch=0-step=3.ckpt"
    resumed = run_ranks(_resume_body, 3, tmp_path, root + "/r", kind, saved, env=LIGHTNING_ENV, timeout=300)[0]
    assert resumed == pytest.approx(straight[3:], rel=1e-5)  # the momentum buffers came back, resharded
    if kind == "sharded":  # fsdp-consolidate writes Muon's state as a plain optimizer state dict
        from fsdp_strategy.checkpoint import consolidate

        plain = torch.load(consolidate(saved, tmp_path / "plain.ckpt"), weights_only=False)
        state = plain["optimizer_states"][0]["state"]
        shapes = sorted(tuple(entry["momentum_buffer"].shape) for entry in state.values())
        assert shapes == sorted([(20, 12), (17, 20), (5, 17)])


def _fabric_body(rank: int, world: int) -> dict:
    from lightning.fabric import Fabric
    from models import make_batches

    from fsdp_strategy import FSDPCustomFabricStrategy

    results = {}
    for name, strategy in [("fsdp", FSDPCustomFabricStrategy(auto_wrap_policy={Block})), ("ddp", DDP)]:
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world)
        fabric.launch()
        module = fabric.setup_module(MuonBesideAdamW())
        hidden = [p for p in module.blocks.parameters() if p.ndim == 2]
        rest = [p for p in module.parameters() if all(p is not h for h in hidden)]
        muon, adamw = fabric.setup_optimizers(MUON(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-2))
        losses = []
        for tokens in make_batches(4, 2 * world):
            rows = tokens[rank::world]
            loss = nn.functional.cross_entropy(module(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
            fabric.backward(loss)
            for optimizer in (muon, adamw):
                optimizer.step()
                optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        results[name] = losses
    return results


def test_muon_beside_adamw_in_fabric_equals_fabric_ddp(tmp_path):
    results = run_ranks(_fabric_body, 2, tmp_path, env=LIGHTNING_ENV, timeout=300)[0]
    assert results["fsdp"] == pytest.approx(results["ddp"], rel=1e-5)


def test_muon_with_adamw_state_dict_round_trips():
    from fsdp_strategy import MuonWithAdamW

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        matrices = [model[0].weight, model[2].weight]
        others = [model[0].bias, model[2].bias]
        return model, MuonWithAdamW(matrices, others, muon={"lr": 0.02}, adamw={"lr": 1e-2})

    def train(model, optimizer, steps, seed):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            model(torch.randn(4, 6, generator=generator)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    straight, straight_optimizer = build()
    train(straight, straight_optimizer, 2, 1)
    saved = (copy.deepcopy(straight.state_dict()), copy.deepcopy(straight_optimizer.state_dict()))
    train(straight, straight_optimizer, 2, 2)
    resumed, optimizer = build()
    resumed.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    assert optimizer.muon.state is optimizer.state and optimizer.adamw.param_groups[0] is optimizer.param_groups[1]
    train(resumed, optimizer, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))


def test_state_placed_for_an_owner_step_follows_torchs_own_rule():
    """Where an owner's step finds its state (torch's rule of ``Optimizer.load_state_dict``), checked on
    the "meta" device standing in for a GPU: a ``step`` count on the host stays there (Adafactor reads
    it without a device wait) unless the group is capturable or fused; any other tensor, a 0-dim one
    loaded on the host under CPU offload too (Amos's ``decay``), goes to the device."""
    from types import SimpleNamespace

    from fsdp_strategy.engine.state_layout import placed_for_step

    weight = nn.Parameter(torch.ones(2, 2))
    param = SimpleNamespace(sharded=weight)
    device = torch.device("meta")
    for capturable, step_device in ((False, "cpu"), (True, "meta")):
        optimizer = torch.optim.Adafactor([weight]) if not capturable else torch.optim.Adam([weight], capturable=True)
        assert placed_for_step(optimizer, param, "step", torch.tensor(3.0), device).device.type == step_device
        assert placed_for_step(optimizer, param, "decay", torch.tensor(0.5), device).device.type == "meta"
        assert placed_for_step(optimizer, param, "exp_avg", torch.zeros(2, 2), device).device.type == "meta"
        assert placed_for_step(optimizer, param, "note", "kept", device) == "kept"
