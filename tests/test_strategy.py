"""The Lightning strategy: real Trainer runs on forked gloo ranks, compared with a plain loop.

The oracle replays Lightning's data order (a shuffled DistributedSampler, seed 0) on one
unsharded copy of the model with the global batch of every step.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from dist_utils import excerpt, free_port, run_ranks
from lightning.pytorch.strategies import StrategyRegistry
from models import Block, TiedLM, lm_loss, make_batches
from oracle import PrecisionOracle, gathered_and_reduced_dtypes
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fsdp_strategy import FSDPCustomPrecision, FSDPCustomStrategy
from fsdp_strategy.options import init_process_group_kwargs

STEPS = 6
PER_RANK = 2
ROOT = Path(__file__).resolve().parents[1]
LIGHTNING_ENV = {"LOCAL_RANK": "{rank}", "NODE_RANK": "0"}


def quiet_trainer(**kwargs) -> L.Trainer:
    """A CPU Trainer without logger, checkpoints, progress bar or summary, unless asked for."""
    defaults = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**defaults, **kwargs})


class LitLM(L.LightningModule):
    """TiedLM with AdamW in two param groups chosen by name (no decay for norms and biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM()
        self.losses: list[float] = []
        self.comm: list[dict] = []

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.net, batch[0])
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", lm_loss(self.net, batch[0]), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", lm_loss(self.net, batch[0]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0][:, :-1]).argmax(-1)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if isinstance(self.trainer.strategy, FSDPCustomStrategy):
            self.comm.append(self.trainer.strategy.comm_ledger.snapshot())
            self.dtypes = gathered_and_reduced_dtypes(self)  # the run's recorder is closed at teardown

    @staticmethod
    def make_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups(module), lr=1e-2)

    def configure_optimizers(self):
        return self.make_optimizer(self)


class SGDLM(LitLM):
    """LitLM with SGD: its update moves with the gradient's scale (AdamW's does not), so a gradient
    divided or multiplied once too often under accumulation or clipping changes the losses."""

    @staticmethod
    def make_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(param_groups(module), lr=0.5)


class ConfiguredLM(LitLM):
    """LitLM whose network is built in ``configure_model`` (under the strategy's init context)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.losses, self.comm = [], []

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            torch.manual_seed(0)
            self.net = TiedLM()


def param_groups(module: torch.nn.Module) -> list[dict]:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    no_decay = [p for n, p in named if "norm" in n or n.endswith("bias")]
    decay = [p for n, p in named if not ("norm" in n or n.endswith("bias"))]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _dataset(world: int, steps: int, accumulate: int) -> torch.Tensor:
    return make_batches(steps * accumulate, PER_RANK * world).reshape(-1, make_batches(1, 1).shape[-1])


def _orders(data: torch.Tensor, world: int) -> list[list[int]]:
    """Each rank's sample order in Lightning's runs (a shuffled DistributedSampler, seed 0)."""
    return [list(DistributedSampler(range(len(data)), world, r, shuffle=True, seed=0)) for r in range(world)]


def _reference(
    model: torch.nn.Module, data: torch.Tensor, world: int, steps: int, accumulate: int, clip: dict, module_cls: type
):
    """Losses of a plain loop replaying Lightning's data order on the global batch."""
    orders = _orders(data, world)
    optimizer = module_cls.make_optimizer(model)
    losses = []
    for step in range(steps):
        batch = range(step * accumulate * PER_RANK, (step + 1) * accumulate * PER_RANK)
        indices = [orders[r][i] for r in range(world) for i in batch]
        loss = lm_loss(model, data[indices])
        loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        if clip.get("gradient_clip_algorithm") == "value":
            torch.nn.utils.clip_grad_value_(params, clip["gradient_clip_val"])
        elif clip:
            torch.nn.utils.clip_grad_norm_(params, clip["gradient_clip_val"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _fit(
    rank: int, world: int, accumulate: int = 1, clip: dict | None = None, module_cls: type = LitLM, **trainer_kwargs
) -> dict:
    torch.manual_seed(0)
    module = module_cls()
    torch.manual_seed(0)
    reference = TiedLM()
    data = _dataset(world, STEPS, accumulate)
    strategy = trainer_kwargs.pop("strategy", None) or FSDPCustomStrategy(auto_wrap_policy={Block})
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **(clip or {}),
        **trainer_kwargs,
    )
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=PER_RANK))
    local = torch.stack(module.losses).view(STEPS, accumulate).sum(1) / accumulate
    dist.all_reduce(local)
    return {
        "loss": (local / world).tolist(),
        "ref_loss": _reference(reference, data, world, STEPS, accumulate, clip or {}, module_cls),
        "comm": module.comm,
        "trainer": trainer,
        "module": module,
        "data": data,
    }


def _precision_reference(data: torch.Tensor, world: int, precision: str, scale: float | None = None) -> list[float]:
    """The losses of ``_fit``'s run at ``precision`` computed by the precision oracle (oracle.py):
    each rank's batch in Lightning's order, gradients summed in the reduce dtype."""
    torch.manual_seed(0)
    oracle = PrecisionOracle(TiedLM(), precision, LitLM.make_optimizer, scale)
    orders, losses = _orders(data, world), []
    for step in range(STEPS):
        rows = range(step * PER_RANK, (step + 1) * PER_RANK)
        per_rank = oracle.micro_batch(lm_loss, [data[[orders[r][i] for i in rows]] for r in range(world)])
        oracle.step(world)
        losses.append(sum(per_rank) / world)
    return losses


def _lightning_body(rank: int, world: int) -> dict:
    norm = _fit(rank, world, clip={"gradient_clip_val": 0.05}, module_cls=SGDLM)
    value = _fit(rank, world, clip={"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}, module_cls=SGDLM)
    accumulate = _fit(rank, world, accumulate=2, module_cls=SGDLM)
    bf16 = _fit(rank, world, precision="bf16-mixed")
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    # a modest initial scale, so no step is skipped for overflow and the run compares step by step
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8)
    fp16 = _fit(rank, world, plugins=[FSDPCustomPrecision("16-mixed", scaler=scaler)])
    bf16_true = _fit(rank, world, precision="bf16-true")
    configured = _fit(rank, world, module_cls=ConfiguredLM)
    data = bf16["data"]
    precision_refs = {
        "bf16": _precision_reference(data, world, "bf16-mixed"),
        "fp16": _precision_reference(data, world, "16-mixed", scale=2.0**8),
        "bf16_true": _precision_reference(data, world, "bf16-true"),
    }
    dtypes = {name: run["module"].dtypes for name, run in (("bf16", bf16), ("fp16", fp16), ("bf16_true", bf16_true))}

    trainer, module, data = norm["trainer"], norm["module"], norm["data"]
    loader = DataLoader(TensorDataset(data[:8]), batch_size=PER_RANK)
    validated = trainer.validate(module, loader, verbose=False)[0]["val_loss"]
    tested = trainer.test(module, loader, verbose=False)[0]["test_loss"]
    predictions = trainer.predict(module, loader)
    scaler = fp16["trainer"].strategy.precision_plugin.scaler
    sharded_dtype = bf16_true["module"].net.blocks[0].up.weight.dtype
    optimizer = trainer.optimizers[0]
    shard_ids = {id(p.sharded) for p in trainer.strategy.scheduler.sharded_params()}
    return {
        "norm": {k: norm[k] for k in ("loss", "ref_loss")},
        "value": {k: value[k] for k in ("loss", "ref_loss")},
        "accumulate": {k: accumulate[k] for k in ("loss", "ref_loss", "comm")},
        "bf16": {"loss": bf16["loss"], "ref_loss": precision_refs["bf16"]},
        "fp16": {"loss": fp16["loss"], "ref_loss": precision_refs["fp16"]},
        "bf16_true": {"loss": bf16_true["loss"], "ref_loss": precision_refs["bf16_true"]},
        "dtypes": dtypes,
        "configure_model": {k: configured[k] for k in ("loss", "ref_loss")},
        "validated": validated,
        "tested": tested,
        "predictions": len(predictions),
        "scaler": [cls.__name__ for cls in type(scaler).__mro__],
        "bf16_true_dtype": str(sharded_dtype),
        "groups_are_shards": all(id(p) in shard_ids for g in optimizer.param_groups for p in g["params"]),
        "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
    }


def test_lightning_fit_matches_reference(tmp_path):
    results = run_ranks(_lightning_body, 2, tmp_path, env=LIGHTNING_ENV, timeout=300)
    result = results[0]
    for name in ("norm", "value", "accumulate", "configure_model"):
        assert result[name]["loss"] == pytest.approx(result[name]["ref_loss"], rel=1e-5), name
    # every step's non-final micro-batch issues no reduce-scatter; the final one reduces all 3 units
    calls = [c.get("reduce_scatter", {}).get("calls", 0) for c in result["accumulate"]["comm"]]
    assert calls == [0, 3] * STEPS
    # low precision against the precision oracle (the same casts and reduce dtypes), as tightly as fp32
    for name in ("bf16", "fp16", "bf16_true"):
        assert result[name]["loss"] == pytest.approx(result[name]["ref_loss"], rel=1e-5), name
    expected = {"bf16": ("bfloat16", "float32"), "fp16": ("float16", "float32"), "bf16_true": ("bfloat16", "bfloat16")}
    for name, (gathered, reduced) in expected.items():
        dtypes = result["dtypes"][name]
        assert dtypes["all_gather"] == {gathered} and dtypes["reduce_scatter"] == {reduced}, (name, dtypes)
    assert "ShardedGradScaler" in result["scaler"]
    assert result["bf16_true_dtype"] == "torch.bfloat16"
    unsharded_groups = [len(g["params"]) for g in param_groups(LitLM())]
    assert result["groups_are_shards"] and result["group_sizes"] == unsharded_groups
    assert result["validated"] == pytest.approx(results[1]["validated"])
    assert 0 < result["validated"] < 10 and 0 < result["tested"] < 10
    assert result["predictions"] == 2


def test_registered_names_and_variants():
    for name in ("fsdp_custom", "fsdp_custom_cpu_offload", "fsdp_custom_shard_grad_op", "fsdp_custom_no_shard"):
        assert name in StrategyRegistry
    offload = L.Trainer(strategy="fsdp_custom_cpu_offload", accelerator="cpu", devices=2, logger=False).strategy
    assert isinstance(offload, FSDPCustomStrategy) and offload.cpu_offload.offload_params
    grad_op = L.Trainer(strategy="fsdp_custom_shard_grad_op", accelerator="cpu", devices=2, logger=False).strategy
    assert grad_op.sharding_strategy.value == "SHARD_GRAD_OP"


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _setup_lines(rank: int, world: int) -> list[str]:
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    quiet_trainer(strategy="fsdp_custom_cpu_offload", devices=world, max_steps=1).fit(_Tiny(), data)
    return [line for line in said if "fsdp_custom: FULL_SHARD over" in line]


def test_the_setup_line_says_that_shards_are_offloaded(tmp_path):
    (line,) = run_ranks(_setup_lines, 1, tmp_path, env=LIGHTNING_ENV)[0]  # a process of its own: its group
    assert line.endswith("; shards offloaded to the CPU"), line


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"auto_wrap_policy": "Block"}, ValueError, "auto_wrap_policy='Block': a class name alone.*dotted"),
        ({"sharding_strategy": "ZERO"}, ValueError, "sharding_strategy='ZERO'.*accepted"),
        ({"activation_checkpointing_policy": 3.5}, TypeError, "activation_checkpointing_policy=3.5"),
        ({"state_dict_type": "npz"}, ValueError, "state_dict_type='npz'.*accepted"),
        ({"device_mesh": (2, 2)}, ValueError, "only used with sharding_strategy='HYBRID_SHARD'"),
        ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 0)}, ValueError, "two positive ints"),
        ({"cpu_offload": "yes"}, TypeError, "cpu_offload must be"),
        (
            {"limit_al_gathers": True},
            TypeError,
            "unexpected argument 'limit_al_gathers'; did you mean 'limit_all_gathers'",
        ),
        ({"colective_timeout": 5}, TypeError, "did you mean 'collective_timeout'.*check_collective_order"),
        ({"tensor_parallel_size": 0}, ValueError, "tensor_parallel_size=0 is not supported; accepted: a positive int"),
        ({"data_parallel_size": "all"}, ValueError, "data_parallel_size='all' is not supported; accepted.*'auto'"),
        (
            {"tensor_parallel_size": 2, "sharding_strategy": "HYBRID_SHARD"},
            ValueError,
            "tensor_parallel_size=2 with a hybrid sharding_strategy.*'FULL_SHARD'",
        ),
        (  # named first, before the budget the memory plan would ask for
            {"tensor_parallel_size": 2, "auto_wrap_policy": "auto"},
            ValueError,
            "tensor_parallel_size=2 with auto_wrap_policy='auto' is not supported",
        ),
        ({"limit_all_gathers": False}, ValueError, "limit_all_gathers=False has no meaning.*one all-gather ahead"),
        ({"use_orig_params": False}, ValueError, "use_orig_params=False has no meaning.*flat parameters"),
        ({"use_orig_params": 1}, ValueError, "use_orig_params=1 has no meaning"),  # True itself, as FSDP's bool
        ({"process_group": "group"}, ValueError, "process_group='group' has no meaning.*device_mesh"),
        ({"device_id": 0}, ValueError, "device_id=0 has no meaning.*devices"),
        ({"timeout": 30}, TypeError, "timeout must be a datetime.timedelta.*got 30"),
        ({"timeout": timedelta(0)}, ValueError, "must be positive"),
        ({"process_group_backend": "glo"}, ValueError, "process_group_backend='glo' is not a backend.*'gloo'"),
        ({"process_group_backend": 1}, TypeError, "process_group_backend must be a string"),
        ({"backward_prefetch": "BACKWARD_MID"}, ValueError, "backward_prefetch='BACKWARD_MID'.*BACKWARD_PRE"),
        ({"forward_prefetch": "yes"}, TypeError, "forward_prefetch must be a bool"),
        ({"sync_module_states": 1}, TypeError, "sync_module_states must be a bool"),
        ({"activation_checkpointing": Block, "activation_checkpointing_policy": {Block}}, ValueError, "both"),
        ({"activation_checkpointing": "Block"}, TypeError, "activation_checkpointing must be a module class"),
        ({"ignored_modules": torch.nn.Linear(2, 2)}, TypeError, "ignored_modules must be a list of modules"),
        ({"collective_timeout": 0}, ValueError, "collective_timeout=0 must be positive"),
        ({"collective_timeout": "5m"}, TypeError, "collective_timeout must be seconds.*got '5m'"),
        ({"check_collective_order": "yes"}, TypeError, "check_collective_order must be a bool"),
        ({"async_save": 1}, TypeError, "async_save must be a bool"),
        ({"async_save": True}, ValueError, "async_save=True needs state_dict_type='sharded'"),
        ({"param_init_fn": 3}, TypeError, "param_init_fn must be a callable"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        FSDPCustomStrategy(**kwargs)


def test_lightning_and_fsdp_arguments_keep_their_meaning():
    strategy = FSDPCustomStrategy(
        use_orig_params=True,
        limit_all_gathers=True,
        activation_checkpointing=[Block],
        backward_prefetch=None,
        process_group_backend="cpu:gloo,cuda:nccl",
        timeout=timedelta(minutes=5),
    )
    assert strategy.activation_checkpointing_policy == {Block} and strategy.backward_prefetch is None
    full = strategy.mixed_precision_config  # an object for every precision, as Lightning's
    assert (full.param_dtype, full.reduce_dtype, full.buffer_dtype) == (torch.float32,) * 3  # "32-true"
    given = FSDPCustomStrategy(mixed_precision={"param_dtype": "bf16"})
    assert given.mixed_precision_config.param_dtype == torch.bfloat16
    trainer = L.Trainer(strategy=FSDPCustomStrategy(), accelerator="cpu", devices=1, precision="bf16-mixed")
    derived = trainer.strategy.mixed_precision_config
    assert (derived.param_dtype, derived.reduce_dtype) == (torch.bfloat16, torch.float32)
    kwargs = init_process_group_kwargs(torch.device("cuda", 1), timedelta(minutes=5))
    assert kwargs["device_id"] == torch.device("cuda", 1)  # NCCL binds the group to the rank's GPU
    assert init_process_group_kwargs(torch.device("cpu"), None)["device_id"] is None


def test_bad_precision_names_value():
    # Lightning builds its FSDPPrecision for every FSDPStrategy (ours too) and names the value and the choices
    with pytest.raises(ValueError, match="precision='64-true'.*is not supported.*must be one of"):
        L.Trainer(strategy="fsdp_custom", accelerator="cpu", devices=2, precision="64-true")


def test_device_mesh_not_matching_world_size_fails_before_process_group(tmp_path):
    strategy = FSDPCustomStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 2\) multiplies to 4, but the world size is 1"):
        trainer.fit(LitLM(), DataLoader(TensorDataset(_dataset(1, 1, 1)), batch_size=2))
    assert not dist.is_initialized()


_EXIT_SCRIPT = """
import atexit, sys
import lightning as L, torch, torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
sys.path.insert(0, {tests!r})
from test_strategy import SequentialLM
from fsdp_strategy import FSDPCustomStrategy
atexit.register(lambda: print("group alive at exit:", dist.is_initialized()))  # runs after later hooks
trainer = L.Trainer(strategy=FSDPCustomStrategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(SequentialLM(), DataLoader(TensorDataset(torch.randint(0, 37, (2, 7))), batch_size=2))
print("group alive after fit:", dist.is_initialized())
"""


def test_gloo_group_created_by_the_strategy_is_destroyed_at_exit():
    # a gloo group left to interpreter shutdown can abort a finished run (SIGABRT under torchrun)
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    script = _EXIT_SCRIPT.format(tests=str(ROOT / "tests"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, excerpt(done.stderr, 3000)
    assert "group alive after fit: True" in done.stdout and "group alive at exit: False" in done.stdout


class SequentialLM(L.LightningModule):
    """Only modules with reset_parameters(), so it can be created on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Embedding(37, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 37))

    def training_step(self, batch, batch_idx):
        logits = self.net(batch[0][:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[0][:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _meta_init_body(rank: int, world: int) -> dict:
    trainer = quiet_trainer(strategy=FSDPCustomStrategy(auto_wrap_policy={torch.nn.Linear}), devices=world, max_steps=2)
    with trainer.init_module(empty_init=True):
        module = SequentialLM()
    created_on_meta = all(p.is_meta for p in module.parameters())
    trainer.fit(module, DataLoader(TensorDataset(make_batches(4, 2 * world).reshape(-1, 7)), batch_size=2))
    shards = trainer.strategy.scheduler.sharded_params()
    return {
        "created_on_meta": created_on_meta,
        "materialized": not any(p.sharded.is_meta for p in shards),
        "finite": all(torch.isfinite(p.sharded).all().item() for p in shards),
        "shard_rows": shards[0].sharded.shape[0],
    }


def test_init_module_empty_init_materializes_unit_by_unit(tmp_path):
    for result in run_ranks(_meta_init_body, 2, tmp_path, env=LIGHTNING_ENV, timeout=120):
        assert result["created_on_meta"] and result["materialized"] and result["finite"]
        assert result["shard_rows"] == 19  # the embedding's 37 rows over 2 ranks: each rank holds its half


def _hybrid_body(rank: int, world: int) -> dict:
    strategy = FSDPCustomStrategy(auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    result = _fit(rank, world, clip={"gradient_clip_val": 0.05}, strategy=strategy)
    unit = result["trainer"].strategy.scheduler.root_unit
    return {
        "loss": result["loss"],
        "ref_loss": result["ref_loss"],
        "groups": (unit.shard_comm.size, unit.replicate_comm.size),
    }


def test_hybrid_shard_through_the_trainer(tmp_path):
    result = run_ranks(_hybrid_body, 4, tmp_path, env=LIGHTNING_ENV, timeout=300)[0]
    assert result["groups"] == (2, 2)
    assert result["loss"] == pytest.approx(result["ref_loss"], rel=1e-5)


class OverflowOnRankOne(LitLM):
    """An overflow in rows of a gradient that only rank 1 holds: rank 0's shards stay finite."""

    def on_after_backward(self) -> None:  # after the reduce-scatter, before the scaler's unscale
        if self.global_rank == 1:
            self.net.blocks[0].up.weight.grad[0, 0] = float("inf")


def _fp16_overflow_body(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    module = OverflowOnRankOne()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8)  # small: no overflow but the planted one
    trainer = quiet_trainer(
        strategy=FSDPCustomStrategy(auto_wrap_policy={Block}),
        devices=world,
        max_steps=1,
        plugins=[FSDPCustomPrecision("16-mixed", scaler=scaler)],
    )
    trainer.fit(module, DataLoader(TensorDataset(_dataset(world, 1, 1)), batch_size=PER_RANK))
    from fsdp_strategy.checkpoint import full_state_dict

    after = full_state_dict(module, rank0_only=False)
    return {
        "unchanged": all(torch.equal(after[n], value) for n, value in before.items()),
        "scale": trainer.strategy.precision_plugin.scaler.get_scale(),
        "scaler": [cls.__name__ for cls in type(trainer.strategy.precision_plugin.scaler).__mro__],
    }


def test_fp16_inf_check_is_all_reduced_so_every_rank_skips_the_step(tmp_path):
    results = run_ranks(_fp16_overflow_body, 2, tmp_path, env=LIGHTNING_ENV, timeout=120)
    for result in results:  # rank 0 saw finite gradients, yet skipped the step like rank 1
        assert "ShardedGradScaler" in result["scaler"] and result["unchanged"]
        assert result["scale"] == 2.0**8 * 0.5  # backed off once, on both ranks


def _sync_module_states_body(rank: int, world: int) -> dict:
    from fsdp_strategy.checkpoint import full_state_dict

    result = {}
    for sync in (True, False):
        torch.manual_seed(rank)  # every rank initializes differently
        module = LitLM()
        initial = {k: v.clone() for k, v in module.state_dict().items()}
        trainer = quiet_trainer(strategy=FSDPCustomStrategy(sync_module_states=sync), devices=world)
        trainer.validate(module, DataLoader(TensorDataset(_dataset(world, 1, 1)), batch_size=2), verbose=False)
        result[sync] = {"initial": initial, "sharded": full_state_dict(trainer.strategy.model, rank0_only=False)}
    return result


def test_sync_module_states_gives_every_rank_rank0s_weights_and_buffers(tmp_path):
    ranks = run_ranks(_sync_module_states_body, 2, tmp_path, env=LIGHTNING_ENV, timeout=120)
    rank0_initial = ranks[0][True]["initial"]
    for result in ranks:
        synced = result[True]["sharded"]
        assert all(torch.equal(synced[k], v) for k, v in rank0_initial.items())  # "net.position" is a buffer
    unsynced = ranks[1][False]["sharded"]  # rows from each rank's own init: neither rank's whole model
    assert not torch.equal(unsynced["net.embed.weight"], rank0_initial["net.embed.weight"])
    assert not torch.equal(unsynced["net.position"], rank0_initial["net.position"])
