"""``Fabric(strategy="fsdp_custom")`` against Fabric's own DDP on the same seed and data, and its
checkpoints: sharded and full round trips, a resume at another world size, ``load_raw``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from dist_utils import excerpt, free_port, run_ranks
from lightning.fabric import Fabric
from models import Block, TiedLM, lm_loss, make_batches
from oracle import PrecisionOracle, gathered_and_reduced_dtypes
from test_strategy import LIGHTNING_ENV

from fsdp_strategy import FSDPCustomFabricStrategy
from fsdp_strategy.checkpoint import CheckpointError, full_state_dict

ACCUMULATE = 2  # micro-batches per optimizer step
GLOBAL = 12  # samples per micro-batch over all ranks (splits evenly over 1, 2, 3 ranks)


def _fabric(strategy: object, world: int) -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world)
    fabric.launch()  # the ranks exist already (LOCAL_RANK is set): nothing is spawned
    return fabric


def _setup(fabric: Fabric, seed: int = 0, joint: bool = False) -> tuple:
    torch.manual_seed(seed)
    with fabric.init_module(empty_init=False):
        model = TiedLM()
    if joint:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return fabric.setup(model, optimizer)
    model = fabric.setup_module(model)
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _steps(fabric: Fabric, model, optimizer, start: int, steps: int) -> tuple[list[float], list[float]]:
    """Optimizer steps ``start ..`` of ``ACCUMULATE`` micro-batches (all but the last under
    ``no_backward_sync``), clipped to norm 0.5: the mean losses and the norms before clipping."""
    rank, world = fabric.global_rank, fabric.world_size
    batches = make_batches(start + steps, ACCUMULATE * GLOBAL)
    losses, norms = [], []
    for step in range(start, start + steps):
        for micro in range(ACCUMULATE):
            rows = batches[step][micro * GLOBAL : (micro + 1) * GLOBAL]
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = lm_loss(model, rows[rank::world])
                fabric.backward(loss / ACCUMULATE)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses, norms


def _against_ddp_body(rank: int, world: int) -> dict:
    runs = {}
    for name, strategy, joint in [
        ("ours", FSDPCustomFabricStrategy(auto_wrap_policy={Block}), False),
        ("joint", "fsdp_custom", True),  # the default wrapping, model and optimizer set up together
        ("ddp", "ddp_find_unused_parameters_true", False),  # TiedLM has an unused module
    ]:
        fabric = _fabric(strategy, world)
        runs[name] = _steps(fabric, *_setup(fabric, joint=joint), 0, 3)
    return runs


@pytest.mark.parametrize("world", [2, 3])
def test_fabric_trains_as_fabric_ddp(tmp_path, world):
    runs = run_ranks(_against_ddp_body, world, tmp_path, env=LIGHTNING_ENV, timeout=300)[0]
    for name in ("ours", "joint"):
        assert runs[name][0] == pytest.approx(runs["ddp"][0], rel=1e-5, abs=1e-6), name  # losses
        assert runs[name][1] == pytest.approx(runs["ddp"][1], rel=1e-5), name  # gradient norms


def _strategy(state_dict_type: str) -> FSDPCustomFabricStrategy:
    return FSDPCustomFabricStrategy(auto_wrap_policy={Block}, state_dict_type=state_dict_type)


def _save_body(rank: int, world: int, folder: str, state_dict_type: str) -> dict:
    """Four steps straight; and two steps, a save, a load into another model, two more steps."""
    fabric = _fabric(_strategy(state_dict_type), world)
    straight = _steps(fabric, *_setup(fabric), 0, 4)[0]
    model, optimizer = _setup(fabric)
    _steps(fabric, model, optimizer, 0, 2)
    fabric.save(f"{folder}/ckpt", {"model": model, "optimizer": optimizer, "iteration": 2, "notes": "kept"})
    model, optimizer = _setup(fabric, seed=1)  # another initialization: everything must come from the file
    state = {"model": model, "optimizer": optimizer, "iteration": 0}
    remainder = fabric.load(f"{folder}/ckpt", state)
    continued = _steps(fabric, model, optimizer, 2, 2)[0]
    return {"straight": straight, "continued": continued, "iteration": state["iteration"], "remainder": remainder}


def _resume_body(rank: int, world: int, folder: str, state_dict_type: str) -> dict:
    fabric = _fabric(_strategy(state_dict_type), world)
    model, optimizer = _setup(fabric, seed=1)
    before = full_state_dict(model, rank0_only=False)
    refused = ""
    try:  # a key the checkpoint lacks: refused before anything is loaded
        fabric.load(f"{folder}/ckpt", {"model": model, "optimizer": optimizer, "iteration": 0, "extra": 5})
    except KeyError as error:
        refused = str(error)
    after = full_state_dict(model, rank0_only=False)
    unchanged = all(torch.equal(before[name], after[name]) for name in before) and not optimizer.state
    state = {"model": model, "optimizer": optimizer, "iteration": 0}
    fabric.load(f"{folder}/ckpt", state)
    continued = _steps(fabric, model, optimizer, 2, 2)[0]
    raw = {}
    if state_dict_type == "full":  # a plain state dict file: load_raw
        if rank == 0:
            torch.save(torch.load(f"{folder}/ckpt", weights_only=True)["model"], f"{folder}/raw.pt")
        fabric.barrier()
        plain = fabric.setup_module(TiedLM())
        with pytest.raises(CheckpointError, match=r"holding the model under \['model'\], not a plain state dict"):
            fabric.load_raw(f"{folder}/ckpt", plain)
        fabric.load_raw(f"{folder}/raw.pt", plain)
        raw = {name: tensor for name, tensor in full_state_dict(plain, rank0_only=False).items()}
        # Fabric's DDP resumes from the same file: the same losses
        ddp = _fabric("ddp_find_unused_parameters_true", world)
        model, optimizer = _setup(ddp, seed=1)
        ddp.load(f"{folder}/ckpt", {"model": model, "optimizer": optimizer})
        raw["ddp_continued"] = _steps(ddp, model, optimizer, 2, 2)[0]
    return {"continued": continued, "iteration": state["iteration"], "raw": raw, "refused": refused, "kept": unchanged}


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_fabric_checkpoints_round_trip_and_resume_at_another_world_size(tmp_path, state_dict_type):
    folder = str(tmp_path)
    saved = run_ranks(_save_body, 2, tmp_path, folder, state_dict_type, env=LIGHTNING_ENV, timeout=300)[0]
    assert saved["continued"] == pytest.approx(saved["straight"][2:], rel=1e-5, abs=1e-6)  # the round trip
    assert saved["iteration"] == 2 and saved["remainder"] == {"notes": "kept"}
    resumed = run_ranks(_resume_body, 3, tmp_path, folder, state_dict_type, env=LIGHTNING_ENV, timeout=300)[0]
    assert resumed["continued"] == pytest.approx(saved["straight"][2:], rel=1e-5, abs=1e-6)  # at world 3
    assert resumed["iteration"] == 2
    assert "extra" in resumed["refused"] and resumed["kept"]  # a failed strict load changed nothing
    if state_dict_type == "full":
        assert resumed["raw"].pop("ddp_continued") == pytest.approx(saved["straight"][2:], rel=1e-5, abs=1e-6)
        stored = torch.load(Path(folder) / "raw.pt")
        assert set(resumed["raw"]) == set(stored)
        assert all(torch.equal(resumed["raw"][name], stored[name]) for name in stored)


def test_fabric_registers_fsdp_custom_and_checks_its_arguments():
    fabric = Fabric(strategy="fsdp_custom", accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy, FSDPCustomFabricStrategy)
    assert fabric.strategy._state_dict_type == "sharded"  # Fabric FSDP's default
    with pytest.raises(TypeError, match="sharding_stratgy"):
        FSDPCustomFabricStrategy(sharding_stratgy="FULL_SHARD")
    with pytest.raises(ValueError, match="sharding_strategy='FULL_SHRAD' is not supported"):
        FSDPCustomFabricStrategy(sharding_strategy="FULL_SHRAD")


def _trainer_save_body(rank: int, world: int, folder: str, state_dict_type: str) -> None:
    from test_strategy import LitLM, quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from fsdp_strategy import FSDPCustomStrategy

    torch.manual_seed(0)
    trainer = quiet_trainer(
        strategy=FSDPCustomStrategy(auto_wrap_policy={Block}, state_dict_type=state_dict_type),
        devices=world,
        max_steps=2,
    )
    trainer.fit(LitLM(), DataLoader(TensorDataset(make_batches(4, 2).reshape(8, -1)), batch_size=2))
    trainer.save_checkpoint(f"{folder}/trainer.ckpt")


def _fabric_load_trainer_body(rank: int, world: int, folder: str) -> dict:
    from test_strategy import LitLM

    from fsdp_strategy.checkpoint import full_optimizer_state_dict

    fabric = _fabric(FSDPCustomFabricStrategy(auto_wrap_policy={Block}), world)
    torch.manual_seed(1)
    model = fabric.setup_module(LitLM())
    optimizer = fabric.setup_optimizers(model.configure_optimizers())
    rest = fabric.load(f"{folder}/trainer.ckpt", {"model": model, "optimizer": optimizer})
    return {
        "weights": full_state_dict(model, rank0_only=False),
        "optimizer": full_optimizer_state_dict(model, optimizer, rank0_only=False),
        "rest": sorted(rest),
    }


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_fabric_loads_the_trainer_strategys_checkpoints_under_its_own_names(tmp_path, state_dict_type):
    from fsdp_strategy.checkpoint import consolidate

    folder = str(tmp_path)
    run_ranks(_trainer_save_body, 2, tmp_path, folder, state_dict_type, env=LIGHTNING_ENV, timeout=300)
    loaded = run_ranks(_fabric_load_trainer_body, 3, tmp_path, folder, env=LIGHTNING_ENV, timeout=300)[0]
    path = tmp_path / "trainer.ckpt"
    saved = torch.load(consolidate(path, tmp_path / "one.ckpt") if path.is_dir() else path, weights_only=False)
    assert set(loaded["weights"]) == set(saved["state_dict"])
    assert all(torch.equal(loaded["weights"][name], value) for name, value in saved["state_dict"].items())
    expected = saved["optimizer_states"][0]["state"]
    assert set(loaded["optimizer"]["state"]) == set(expected)
    for position, entry in expected.items():
        assert torch.equal(loaded["optimizer"]["state"][position]["exp_avg"], entry["exp_avg"]), position
    assert "loops" in loaded["rest"] and "global_step" in loaded["rest"]  # the Trainer's state comes back as is


def _precision_body(rank: int, world: int, precision: str) -> dict:
    """Three steps of ``_steps`` (accumulation under no_backward_sync, clipping) at ``precision``, and
    the same steps of the precision oracle (the weights cast as the engine gathers them, gradients
    summed in the reduce dtype), from the same initialization."""
    fabric = Fabric(strategy=FSDPCustomFabricStrategy(auto_wrap_policy={Block}), accelerator="cpu", devices=world,
                    precision=precision)  # fmt: skip
    fabric.launch()
    model, optimizer = _setup(fabric)
    losses, norms = _steps(fabric, model, optimizer, 0, 3)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        reference = TiedLM()
    oracle = PrecisionOracle(reference, precision, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    ref_losses, ref_norms = [], []
    batches = make_batches(3, ACCUMULATE * GLOBAL)
    for step in range(3):
        for micro in range(ACCUMULATE):
            rows = batches[step][micro * GLOBAL : (micro + 1) * GLOBAL]
            with fabric.strategy.precision.forward_context() if not precision.endswith("-mixed") else nullcontext():
                per_rank = oracle.micro_batch(lm_loss, [rows[r::world] for r in range(world)], divide=ACCUMULATE)
        ref_norms.append(oracle.step(world, clip_norm=0.5))
        ref_losses.append(sum(per_rank) / world)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "dtypes": gathered_and_reduced_dtypes(model),
    }


@pytest.mark.parametrize(
    ("precision", "gathered", "reduced"),
    [("bf16-mixed", "bfloat16", "float32"), ("bf16-true", "bfloat16", "bfloat16")],  # 16-mixed is bf16 on a CPU
)
def test_fabric_precisions_equal_the_precision_oracle(tmp_path, precision, gathered, reduced):
    env = {**LIGHTNING_ENV, "TORCH_DISTRIBUTED_DEBUG": "OFF"}
    run = run_ranks(_precision_body, 2, tmp_path, precision, env=env, timeout=300)[0]
    assert run["dtypes"]["all_gather"] == {gathered} and run["dtypes"]["reduce_scatter"] == {reduced}, run["dtypes"]
    assert run["losses"] == pytest.approx(run["ref_losses"], rel=1e-5), run
    assert run["norms"] == pytest.approx(run["ref_norms"], rel=1e-5), run


def test_fabric_16_mixed_gets_a_sharded_grad_scaler():
    from lightning.fabric.plugins import MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fsdp_strategy import FSDPCustomFabricPrecision

    plugin = FSDPCustomFabricPrecision.from_plugin(MixedPrecision("16-mixed", "cuda"))
    plugin.attach("cpu")
    assert isinstance(plugin.scaler, ShardedGradScaler)  # its inf check covers every rank's shards
    assert plugin.mixed_precision_config.param_dtype == torch.float16
    with pytest.raises(TypeError, match="cannot honour the precision plugin"):
        FSDPCustomFabricPrecision.from_plugin(type("Custom", (MixedPrecision,), {})("bf16-mixed", "cpu"))


FABRIC_JOB = str(Path(__file__).with_name("faulty_fabric_job.py"))


def _job(command: list[str], cwd: Path) -> tuple[int, str, float]:
    """Run a job in ``cwd`` (its flight recorder rings go there): return code, output, seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable if part == "python" else part.format(port=free_port()) for part in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        start_new_session=True,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


@pytest.mark.parametrize(
    "launch",
    [
        ["python", FABRIC_JOB],
        # torchrun ends the other ranks 0.1 s after one dies (its default monitor interval), often before
        # they print; 2 s lets rank 0 say what it saw, which is what this test reads
        ["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "--monitor-interval=2", "--master_port={port}"]
        + [FABRIC_JOB],
    ],
    ids=["fabric.launch", "torchrun"],
)
def test_a_dead_rank_under_fabric_is_named(tmp_path, launch):
    code, output, seconds = _job([*launch, "--fault", "kill", "--rank", "1", "--step", "3"], tmp_path)
    assert code != 0 and "FINISHED" not in output
    assert seconds < 60, excerpt(output, 3000)
    assert "fsdp_custom: rank 0 (node 0) stopped at all_gather #" in output, excerpt(output, 4000)
    assert "rank 1 (node 0, host" in output and "LOST, its process has exited" in output, excerpt(output, 4000)


def test_fabric_run_launches_a_script_with_the_strategy(tmp_path):
    fabric_cli = shutil.which("fabric") or str(Path(sys.executable).with_name("fabric"))
    code, output, _ = _job([fabric_cli, "run", "--accelerator=cpu", "--devices=2", FABRIC_JOB], tmp_path)
    assert code == 0 and "FINISHED on 2 ranks" in output, excerpt(output, 3000)


def _fabric_fsdp_layouts_body(rank: int, world: int, folder: str) -> dict:
    """Two steps under Fabric's DDP; rank 0 writes its state in Fabric FSDP's layouts (made from
    the DDP state: Fabric's FSDP needs CUDA, and the layout is what matters): a sharded folder (DCP
    keys ``model`` and ``optimizer`` keyed by parameter name, ``meta.pt``) and a full file."""
    import torch.distributed.checkpoint as dcp

    fabric = _fabric("ddp_find_unused_parameters_true", world)
    model, optimizer = _setup(fabric)
    _steps(fabric, model, optimizer, 0, 2)
    if rank == 0:
        names = {id(p): name for name, p in model.module.named_parameters()}  # without DDP's prefixes
        saved = optimizer.state_dict()
        name_of = dict(enumerate(names[id(p)] for group in optimizer.param_groups for p in group["params"]))
        by_name = {
            "state": {name_of[i]: value for i, value in saved["state"].items()},
            "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]],
        }
        state = {"model": model.state_dict(), "optimizer": by_name}
        dcp.save(state, checkpoint_id=f"{folder}/fsdp.ckpt", no_dist=True)
        torch.save({"step": 2}, f"{folder}/fsdp.ckpt/meta.pt")
        torch.save({**state, "step": 2}, f"{folder}/fsdp_full.ckpt")
        torch.save({"model": model.state_dict(), "optimizer": saved}, f"{folder}/ddp.ckpt")
    fabric.barrier()
    return {}


def _load_fabric_fsdp_body(rank: int, world: int, folder: str, name: str) -> dict:
    from fsdp_strategy.checkpoint import full_optimizer_state_dict

    fabric = _fabric(FSDPCustomFabricStrategy(auto_wrap_policy={Block}), world)
    model, optimizer = _setup(fabric, seed=1)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{folder}/{name}", state)
    return {
        "weights": full_state_dict(model, rank0_only=False),
        "optimizer": full_optimizer_state_dict(model, optimizer, rank0_only=False),
        "step": state["step"],
    }


@pytest.mark.parametrize("name", ["fsdp.ckpt", "fsdp_full.ckpt"])
def test_fabric_loads_fabric_fsdps_layouts_at_another_world_size(tmp_path, name):
    folder = str(tmp_path)
    run_ranks(_fabric_fsdp_layouts_body, 2, tmp_path, folder, env=LIGHTNING_ENV, timeout=300)
    loaded = run_ranks(_load_fabric_fsdp_body, 3, tmp_path, folder, name, env=LIGHTNING_ENV, timeout=300)[0]
    ddp = torch.load(tmp_path / "ddp.ckpt", weights_only=True)
    assert loaded["step"] == 2
    assert all(torch.equal(loaded["weights"][key], value) for key, value in ddp["model"].items())
    assert set(loaded["optimizer"]["state"]) == set(ddp["optimizer"]["state"])
    for position, entry in ddp["optimizer"]["state"].items():
        assert torch.equal(loaded["optimizer"]["state"][position]["exp_avg_sq"], entry["exp_avg_sq"]), position


def _trainer_resumes_fabric_folder_body(rank: int, world: int, folder: str) -> dict:
    import logging

    from test_strategy import LitLM, quiet_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from fsdp_strategy import FSDPCustomStrategy

    class Restored(LitLM):
        def forward(self, tokens):
            return self.net(tokens)

        def configure_optimizers(self):  # as the Fabric loop made it: one param group
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def on_train_start(self):  # the checkpoint is in effect before the first step
            self.at_start = full_state_dict(self, rank0_only=False)
            self.adam_steps = [float(s["step"]) for s in self.trainer.optimizers[0].state.values()]

    fabric = _fabric(FSDPCustomFabricStrategy(auto_wrap_policy={Block}), world)
    torch.manual_seed(0)
    model = fabric.setup_module(Restored())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _steps(fabric, model, optimizer, 0, 1)
    fabric.save(f"{folder}/fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    saved = full_state_dict(fabric.strategy.model, rank0_only=False)
    fabric.strategy.teardown()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    module = Restored()
    trainer = quiet_trainer(strategy=FSDPCustomStrategy(auto_wrap_policy={Block}), devices=world, max_steps=2)
    loader = DataLoader(TensorDataset(make_batches(4, 2).reshape(8, -1)), batch_size=2)
    trainer.fit(module, loader, ckpt_path=f"{folder}/fabric.ckpt")
    equal = all(torch.equal(module.at_start[key], value) for key, value in saved.items())
    return {"equal": equal, "adam_steps": module.adam_steps, "step": trainer.global_step, "log": records}


def test_the_trainer_resumes_a_fabric_folder_with_fresh_loops(tmp_path):
    result = run_ranks(_trainer_resumes_fabric_folder_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV)[0]
    assert result["equal"] and result["adam_steps"] and set(result["adam_steps"]) == {1.0}  # weights and Adam's state
    assert result["step"] == 2  # the loops started fresh: 2 steps trained
    assert any("holds no Lightning state" in line and "start fresh" in line for line in result["log"]), result["log"]
