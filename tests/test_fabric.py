"""``Fabric(strategy="fsdp_custom")`` against Fabric's own DDP on the same seed and data, and its
checkpoints: sharded and full round trips, a resume at another world size, ``load_raw``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from lightning.fabric import Fabric
from models import Block, TiedLM, lm_loss, make_batches
from test_strategy import LIGHTNING_ENV

from fsdp_strategy import FSDPCustomFabricStrategy
from fsdp_strategy.checkpoint import full_state_dict

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
    state = {"model": model, "optimizer": optimizer, "iteration": 0}
    fabric.load(f"{folder}/ckpt", state)
    continued = _steps(fabric, model, optimizer, 2, 2)[0]
    raw = {}
    if state_dict_type == "full":  # a plain state dict file: load_raw
        if rank == 0:
            torch.save(torch.load(f"{folder}/ckpt", weights_only=True)["model"], f"{folder}/raw.pt")
        fabric.barrier()
        plain = fabric.setup_module(TiedLM())
        fabric.load_raw(f"{folder}/raw.pt", plain)
        raw = {name: tensor for name, tensor in full_state_dict(plain, rank0_only=False).items()}
    return {"continued": continued, "iteration": state["iteration"], "raw": raw}


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_fabric_checkpoints_round_trip_and_resume_at_another_world_size(tmp_path, state_dict_type):
    folder = str(tmp_path)
    saved = run_ranks(_save_body, 2, tmp_path, folder, state_dict_type, env=LIGHTNING_ENV, timeout=300)[0]
    assert saved["continued"] == pytest.approx(saved["straight"][2:], rel=1e-5, abs=1e-6)  # the round trip
    assert saved["iteration"] == 2 and saved["remainder"] == {"notes": "kept"}
    resumed = run_ranks(_resume_body, 3, tmp_path, folder, state_dict_type, env=LIGHTNING_ENV, timeout=300)[0]
    assert resumed["continued"] == pytest.approx(saved["straight"][2:], rel=1e-5, abs=1e-6)  # at world 3
    assert resumed["iteration"] == 2
    if state_dict_type == "full":
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
