"""Checkpoints of 2-D models (issue 50): a sharded folder of a model split by ``parallelize_module``
and sharded by ``shard_model`` holds FSDP2's chunks for the same layout, and loads exactly into
other layouts (2x2, 4x1 plain, 1x2, one process), as a full checkpoint does: the losses of the
steps after the load equal those of one process that trained on the global batches throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from tp_models import Block, TinyLM, batches, lm_loss, parallelize

from fsdp_strategy.checkpoint import (
    consolidate,
    full_optimizer_state_dict,
    full_state_dict,
    load_folder,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    save_folder,
)
from fsdp_strategy.engine import shard_model

BEFORE, AFTER, BATCH = 2, 2, 4  # steps before the save, steps after the load, global batch rows


def _oracle() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process on the global batches: the losses of the steps after the save, the weights at it
    and at the end."""
    torch.manual_seed(0)
    model = TinyLM().double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses, saved = [], {}
    for step, (tokens, targets) in enumerate(batches(BEFORE + AFTER, BATCH)):
        if step == BEFORE:
            saved = {name: p.detach().clone() for name, p in model.named_parameters()}
        loss = lm_loss(model(tokens), targets)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses[BEFORE:], saved, {name: p.detach() for name, p in model.named_parameters()}


def _build(dp: int, tp: int, seed: int = 0) -> tuple[TinyLM, torch.optim.Optimizer, int]:
    """A TinyLM at dp x tp (tp 1: a plain model sharded over every rank), per-block units, AdamW;
    ``seed`` other than 0 starts it elsewhere (a load must overwrite everything)."""
    torch.manual_seed(seed)
    model = TinyLM().double()
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
        parallelize(model, mesh["tensor_parallel"])
        group, data_rank = mesh["data_parallel"].get_group(), mesh["data_parallel"].get_local_rank()
    else:
        group, data_rank = None, dist.get_rank()
    shard_model(model, auto_wrap_policy={Block}, process_group=group)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), data_rank


def _train(model: TinyLM, optimizer: torch.optim.Optimizer, dp: int, data_rank: int, steps: range) -> list[float]:
    """Train ``steps`` of the global batches, each data-parallel rank on its rows; the global losses."""
    rows, losses = BATCH // dp, []
    every = batches(BEFORE + AFTER, BATCH)
    for step in steps:
        tokens, targets = every[step]
        mine = slice(data_rank * rows, (data_rank + 1) * rows)
        loss = lm_loss(model(tokens[mine]), targets[mine])
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _chunks(folder: str, prefix: str) -> dict[str, list[tuple]]:
    """``key -> sorted (offsets, sizes)`` of a DCP folder's tensors under ``prefix``."""
    metadata = dcp.FileSystemReader(folder).read_metadata()
    return {
        key.removeprefix(prefix): sorted((tuple(c.offsets), tuple(c.sizes)) for c in info.chunks)
        for key, info in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(info, "chunks")
    }


def _fsdp2_model() -> TinyLM:
    """The same model under FSDP2 at 2x2 (``fully_shard`` per block and the root), seed 0's weights."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM().double()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    parallelize(model, mesh["tensor_parallel"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def _with_fsdp2(root: str, ours: str) -> dict:
    """Both ways with FSDP2 at 2x2: its folder of seed 0's weights into ours (seed 1), full weights
    after; our folder into it, its full weights after."""
    model = _fsdp2_model()
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{root}/fsdp2")
    fresh, _, _ = _build(2, 2, seed=1)
    load_folder(f"{root}/fsdp2", fresh, [])
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=ours)
    full = {name: value.full_tensor() for name, value in state["model"].items()}
    return {"fsdp2->ours": full_state_dict(fresh, rank0_only=False), "ours->fsdp2": full}


def _four_ranks(rank: int, world: int, root: str) -> dict:
    told: dict = {}
    two_by_two, plain = f"{root}/2x2", f"{root}/4x1"
    model, optimizer, data_rank = _build(2, 2)
    _train(model, optimizer, 2, data_rank, range(BEFORE))
    save_folder(two_by_two, model, [optimizer], {"step": BEFORE})
    weights, moments = full_state_dict(model, rank0_only=False), full_optimizer_state_dict(model, optimizer, False)
    told["full_weights"] = weights
    for key, (dp, tp) in {"2x2": (2, 2), "4x1": (4, 1)}.items():  # the folder into a fresh model elsewhere
        fresh, fresh_optimizer, fresh_rank = _build(dp, tp, seed=1)
        load_folder(two_by_two, fresh, [fresh_optimizer])
        told[f"folder->{key}"] = _train(fresh, fresh_optimizer, dp, fresh_rank, range(BEFORE, BEFORE + AFTER))
        if key == "4x1":
            save_folder(plain, fresh, [fresh_optimizer], {})  # after the steps: 4x1 -> 2x2 resumes from there
    fresh, fresh_optimizer, fresh_rank = _build(2, 2, seed=1)  # the full checkpoint into a fresh 2x2
    load_full_state_dict(fresh, weights)
    load_full_optimizer_state_dict(fresh, fresh_optimizer, moments)
    told["full->2x2"] = _train(fresh, fresh_optimizer, 2, fresh_rank, range(BEFORE, BEFORE + AFTER))
    fresh, fresh_optimizer, fresh_rank = _build(2, 2, seed=1)
    load_folder(plain, fresh, [fresh_optimizer])
    told["4x1->2x2"] = full_state_dict(fresh, rank0_only=False)
    told.update(_with_fsdp2(root, two_by_two))
    if rank == 0:
        told["chunks"] = (_chunks(two_by_two, "model."), _chunks(f"{root}/fsdp2", "model."))
    return told


def _two_ranks(rank: int, world: int, folder: str) -> list[float]:
    model, optimizer, data_rank = _build(1, 2, seed=1)
    load_folder(folder, model, [optimizer])
    return _train(model, optimizer, 1, data_rank, range(BEFORE, BEFORE + AFTER))


def _one_process(folder: Path) -> list[float]:
    """``fsdp-consolidate``'s file of the 2x2 folder into a plain model and optimizer: the losses after."""
    consolidate(folder, folder.with_suffix(".ckpt"))
    checkpoint = torch.load(folder.with_suffix(".ckpt"), weights_only=True)
    model = TinyLM().double()
    model.load_state_dict(checkpoint["state_dict"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    losses = []
    for tokens, targets in batches(BEFORE + AFTER, BATCH)[BEFORE:]:
        loss = lm_loss(model(tokens), targets)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def test_a_two_d_sharded_folder_holds_fsdp2s_chunks_and_loads_into_other_layouts(tmp_path):
    losses, saved, final = _oracle()
    results = run_ranks(_four_ranks, 4, tmp_path, str(tmp_path), timeout=300)
    ours, fsdp2 = results[0]["chunks"]
    assert ours == fsdp2 and len(ours) == len(saved), (ours, fsdp2)
    assert any(len(chunks) == 4 for chunks in ours.values())  # TP-split weights: four chunks, not two
    for told in results:
        for name, value in saved.items():
            assert torch.allclose(told["full_weights"][name], value, rtol=1e-12, atol=0), name
        for key in ("folder->2x2", "folder->4x1", "full->2x2"):
            assert told[key] == pytest.approx(losses, rel=1e-12, abs=0), (key, told[key], losses)
    torch.manual_seed(0)
    initial = dict(TinyLM().double().named_parameters())
    for told in results:  # FSDP2's folder into ours and ours into FSDP2, element for element
        for name in saved:
            assert torch.equal(told["fsdp2->ours"][name], initial[name].detach()), name
            assert torch.equal(told["ours->fsdp2"][name], told["full_weights"][name]), name
    for told in run_ranks(_two_ranks, 2, tmp_path, str(tmp_path / "2x2"), timeout=300):
        assert told == pytest.approx(losses, rel=1e-12, abs=0), ("1x2", told, losses)
    assert _one_process(tmp_path / "2x2") == pytest.approx(losses, rel=1e-12, abs=0)
    for told in results:  # 4x1 -> 2x2: the 4x1 model's folder after its steps holds the final weights
        for name, value in final.items():
            assert torch.allclose(told["4x1->2x2"][name], value, rtol=1e-12, atol=0), name
