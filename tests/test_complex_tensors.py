"""Complex tensors stay complex: a rotary table kept as complex64 (``freqs_cis``, made by
``torch.polar``, as Meta's Llama, torchtitan and Lightning's tensor-parallel example keep it) and a
complex parameter, under every precision of the Trainer and Fabric, in the engine's gathers and
reductions (with and without ``param_dtype``), in checkpoints and in the memory plan.

Oracles: Lightning's DDP (Trainer) and Fabric's DDP at "32-true" and "bf16-mixed"; a single process
on the global batch for the engine (world 2 and 3, per-block units and the default wrapping); the
exact byte count for the plan. Under "*-true" Lightning's own DDP drops the imaginary part, so
there the buffer's and parameter's dtypes and values are the check."""

from __future__ import annotations

import copy
import io
import math

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from lightning.fabric import Fabric
from oracle import PrecisionOracle, assert_matches, train_pair, weight_error
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomFabricStrategy, FSDPCustomStrategy, MixedPrecision
from fsdp_strategy.checkpoint import consolidate, full_state_dict, load_full_state_dict
from fsdp_strategy.engine import get_scheduler, shard_model
from fsdp_strategy.plan import plan

VOCAB, DIM, SEQ, STEPS, PER_RANK = 29, 8, 6, 3, 2


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Meta's ``apply_rotary_emb``: pairs of features as complex numbers, turned by ``freqs_cis``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis).flatten(-2).type_as(x)


class RotaryBlock(nn.Module):
    """Causal single-head attention with rotary positions; the queries' rotation is shifted by a
    learned complex phase (a complex parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.phase = nn.Parameter(torch.polar(torch.ones(DIM // 2), torch.randn(DIM // 2)))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k = rotate(q, freqs_cis * self.phase), rotate(k, freqs_cis)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attended)


class RotaryLM(nn.Module):
    """Two rotary blocks over a complex64 ``freqs_cis`` buffer, with an integer and a float64 buffer beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([RotaryBlock(), RotaryBlock()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        inverse = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
        angles = torch.outer(torch.arange(SEQ).float(), inverse)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))
        self.register_buffer("positions", torch.arange(SEQ))
        self.register_buffer("counts", torch.zeros(3, dtype=torch.float64))  # a float64 buffer "32-true" keeps

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.freqs_cis[self.positions[: tokens.shape[1]]])
        return self.head(x)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def batches(world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS * PER_RANK * world, SEQ + 1), generator=generator)


def dtypes_of(model: nn.Module) -> dict[str, torch.dtype]:
    return {
        "freqs_cis": model.freqs_cis.dtype,
        "positions": model.positions.dtype,
        "phase": model.blocks[0].phase.dtype,
        "weight": model.head.weight.dtype,
        "counts": model.counts.dtype,
    }


# ---- the engine, against one process on the global batch ---------------------------------------


def _engine_body(rank: int, world: int) -> dict:
    data = batches(world).view(STEPS, world, PER_RANK, SEQ + 1)

    def loss_fn(model, batch, rank, step):
        return lm_loss(model, batch)

    results = {}
    for name, wrap in (("per-block", {RotaryBlock}), ("default", None)):
        batches_of = lambda step, world: list(data[step])  # noqa: E731
        results[name] = train_pair(rank, world, RotaryLM, loss_fn, batches_of, STEPS, auto_wrap_policy=wrap)
    # bf16 gathers: the complex parameter is gathered as complex64 beside bf16 weights (bytes on the wire)
    torch.manual_seed(0)
    model = RotaryLM()
    oracle = PrecisionOracle(copy.deepcopy(model), "bf16-mixed", lambda m: torch.optim.AdamW(m.parameters()))
    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_model(model, auto_wrap_policy={RotaryBlock}, mixed_precision=precision)
    optimizer = torch.optim.AdamW(model.parameters())
    losses, ref_losses, gathered = [], [], {}
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, data[step, rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        ref_losses.append(oracle.micro_batch(lambda m, b: lm_loss(m, b), list(data[step]))[rank])
        oracle.step(world)
    scheduler = get_scheduler(model)
    unit = next(u for u in scheduler.units if u.name == "blocks.0")
    unit.wait_unshard()
    gathered = {"phase": model.blocks[0].phase.detach().clone(), "qkv": model.blocks[0].qkv.weight.dtype}
    unit.reshard()
    # a unit of float64 beside float32 parameters gathers bytes; its full state dict must save (copies, not views)
    mixed = shard_model(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3).double()))
    buffer = io.BytesIO()
    torch.save(full_state_dict(mixed, rank0_only=False), buffer)
    results["mixed saved"] = buffer.tell() > 0
    # complex pairs at an odd offset of the flat buffer (after 3 real elements), or in rows of an odd length
    values = {"a": torch.arange(3.0), "b": torch.tensor([5.0]), "c": torch.tensor([1 + 2j, 3 - 4j])}
    values["d"] = torch.tensor([7.0])
    for strategy in ("NO_SHARD", "FULL_SHARD"):
        for names in (("a", "c"), ("a", "b", "c", "d")):
            expected = {k: values[k] for k in names}
            odd = nn.ParameterDict({k: nn.Parameter(v.clone()) for k, v in expected.items()})
            shard_model(odd, sharding_strategy=strategy)
            saved = full_state_dict(odd, rank0_only=False)
            loaded = {k: v * 2 for k, v in expected.items()}
            load_full_state_dict(odd, loaded)
            again = full_state_dict(odd, rank0_only=False)
            results[f"odd {names} {strategy}"] = all(
                torch.equal(saved[k], expected[k]) and torch.equal(again[k], loaded[k]) for k in expected
            )
    results["bf16"] = {
        "losses": losses,
        "ref_losses": ref_losses,
        "weight_error": weight_error(model, oracle.master),
        "gathered": gathered,
        "master_phase": full_state_dict(model, rank0_only=False)["blocks.0.phase"],
    }
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_complex_parameters_and_buffers_train_as_one_process(tmp_path, world):
    results = run_ranks(_engine_body, world, tmp_path, timeout=240)[0]
    assert_matches(results["per-block"], "per-block units")
    assert_matches(results["default"], "the default wrapping")
    bf16 = results["bf16"]
    assert bf16["gathered"]["qkv"] == torch.bfloat16
    assert bf16["gathered"]["phase"].dtype == torch.complex64  # not cast to bf16, imaginary part kept
    assert torch.equal(bf16["gathered"]["phase"], bf16["master_phase"])
    assert_matches(bf16, "bf16 gathers", rel=2e-3)
    assert results["mixed saved"]
    assert all(ok for key, ok in results.items() if key.startswith("odd")), results


# ---- the Trainer and Fabric, every precision ---------------------------------------------------


class RotaryModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = RotaryLM()
        self.losses: list[float] = []
        self.seen: dict = {}

    def on_train_start(self) -> None:
        self.seen = dtypes_of(self.model)
        self.seen["freqs_value"] = self.model.freqs_cis.detach().cpu().clone()

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model, batch[0])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _trainer_run(world: int, strategy, precision: str, root: str | None = None) -> dict:
    torch.manual_seed(0)
    module = RotaryModule()
    trainer = quiet_trainer(strategy=strategy, devices=world, max_steps=STEPS, precision=precision)
    trainer.fit(module, DataLoader(TensorDataset(batches(world)), batch_size=PER_RANK))
    losses = torch.tensor(module.losses)
    dist.all_reduce(losses)
    run = {"losses": (losses / world).tolist(), "seen": module.seen}
    if root is not None:
        run["state"] = full_state_dict(trainer.strategy.model, rank0_only=False)
        for kind in ("sharded", "full"):
            trainer.strategy._state_dict_type = kind  # as Lightning's FSDPStrategy keeps it
            trainer.save_checkpoint(f"{root}/{kind}.ckpt")
        torch.manual_seed(1)  # other weights: the restore must bring the saved ones
        restored = RotaryModule()
        strategy = FSDPCustomStrategy(auto_wrap_policy={RotaryBlock})
        trainer = quiet_trainer(strategy=strategy, devices=world, max_steps=STEPS)
        loader = DataLoader(TensorDataset(batches(world)), batch_size=PER_RANK)
        trainer.fit(restored, loader, ckpt_path=f"{root}/sharded.ckpt")  # restored, then nothing left to train
        run["restored"] = full_state_dict(trainer.strategy.model, rank0_only=False)
        if dist.get_rank() == 0:  # a full checkpoint whose rotary table is its real part (as 0.2.0 saved it)
            old = torch.load(f"{root}/full.ckpt", weights_only=True)
            old["state_dict"]["model.freqs_cis"] = old["state_dict"]["model.freqs_cis"].real.clone()
            torch.save(old, f"{root}/real_freqs.ckpt")
        dist.barrier()
        trainer = quiet_trainer(strategy=FSDPCustomStrategy(), devices=world, max_steps=STEPS)
        try:
            trainer.fit(RotaryModule(), loader, ckpt_path=f"{root}/real_freqs.ckpt")
        except Exception as error:  # noqa: BLE001 - the message is the check
            run["real_freqs"] = f"{type(error).__name__}: {error}"
    return run


def _fabric_run(world: int, strategy, precision: str) -> dict:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world, precision=precision)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(RotaryLM())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    seen = dtypes_of(model.module)
    data = batches(world).view(STEPS, world, PER_RANK, SEQ + 1)
    losses = []
    for step in range(STEPS):
        loss = lm_loss(model, data[step, fabric.global_rank])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return {"losses": losses, "seen": seen}


def _lightning_body(rank: int, world: int, root: str) -> dict:
    per_block = {"auto_wrap_policy": {RotaryBlock}}
    runs = {}
    for precision in ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"):
        save = root if precision == "32-true" else None
        runs[("ours", precision)] = _trainer_run(world, FSDPCustomStrategy(**per_block), precision, save)
    for precision in ("32-true", "bf16-mixed"):
        runs[("ddp", precision)] = _trainer_run(world, "ddp", precision)
        runs[("fabric ours", precision)] = _fabric_run(world, FSDPCustomFabricStrategy(**per_block), precision)
        runs[("fabric ddp", precision)] = _fabric_run(world, "ddp", precision)
    runs[("fabric ours", "bf16-true")] = _fabric_run(world, FSDPCustomFabricStrategy(**per_block), "bf16-true")
    return runs


def test_every_precision_keeps_complex_tensors_and_equals_ddp(tmp_path):
    runs = run_ranks(_lightning_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=400)[0]
    expected_freqs = RotaryLM().freqs_cis
    low = {"32-true": torch.float32, "bf16-mixed": torch.float32, "16-mixed": torch.float32}
    low.update({"bf16-true": torch.bfloat16, "16-true": torch.float16})
    counts = {"32-true": torch.float64, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}  # buffer_dtype
    counts.update({"bf16-true": torch.bfloat16, "16-true": torch.float16})
    for (who, precision), run in runs.items():
        if "ddp" in who:
            continue
        seen = run["seen"]
        assert seen["freqs_cis"] == seen["phase"] == torch.complex64, (who, precision, seen)
        assert (seen["positions"], seen["weight"]) == (torch.int64, low[precision]), (who, precision, seen)
        assert seen["counts"] == counts[precision], (who, precision, seen)
        if "freqs_value" in seen:
            assert torch.allclose(seen["freqs_value"].to(torch.complex64), expected_freqs, atol=1e-3), precision
    for prefix in ("", "fabric "):
        ours, ddp = runs[(f"{prefix}ours", "32-true")], runs[(f"{prefix}ddp", "32-true")]
        assert ours["losses"] == pytest.approx(ddp["losses"], rel=1e-5), prefix
        ours, ddp = runs[(f"{prefix}ours", "bf16-mixed")], runs[(f"{prefix}ddp", "bf16-mixed")]
        assert ours["losses"] == pytest.approx(ddp["losses"], rel=2e-3), prefix
    # checkpoints keep them complex: the sharded folder restored, consolidated and the full file
    saved = runs[("ours", "32-true")]["state"]
    one_file = consolidate(tmp_path / "sharded.ckpt", tmp_path / "one.pt")
    consolidated = torch.load(one_file, weights_only=True)["state_dict"]
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)["state_dict"]
    assert "CheckpointError" in runs[("ours", "32-true")]["real_freqs"]
    assert "'model.freqs_cis' as float32 and the model as complex64" in runs[("ours", "32-true")]["real_freqs"]
    for name in ("model.blocks.0.phase", "model.freqs_cis"):
        for state in (runs[("ours", "32-true")]["restored"], consolidated, full):
            assert state[name].dtype == torch.complex64 and torch.equal(state[name], saved[name]), name


def test_the_memory_plan_counts_complex_parameters_at_their_size():
    model = RotaryLM()
    result = plan(model, torch.zeros(4, SEQ, dtype=torch.long), world_size=2, auto_wrap_policy={RotaryBlock})
    expected = sum(math.ceil(p.shape[0] / 2) * math.prod(p.shape[1:]) * p.element_size() for p in model.parameters())
    assert any(p.is_complex() for p in model.parameters())
    assert result.parts["parameter shards"] == expected
