"""Checkpoints of 2-D models (issue 50): a sharded folder of a model split by ``parallelize_module``
and sharded by ``shard_model`` holds FSDP2's chunks for the same layout, and loads exactly into
other layouts (2x2, 4x1 plain, 1x2, one process), as a full checkpoint does: the losses of the
steps after the load equal those of one process that trained on the global batches throughout."""

from __future__ import annotations

import re
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
    state = {"state_dict": model.state_dict()}  # ours of a 2-D model: ModelParallelStrategy's key
    dcp.load(state, checkpoint_id=ours)
    full = {name: value.full_tensor() for name, value in state["state_dict"].items()}
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
        told["chunks"] = (_chunks(two_by_two, "state_dict."), _chunks(f"{root}/fsdp2", "model."))
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


def _save_then_load_damaged(rank: int, world: int, root: str, damage: str) -> tuple[bool, str]:
    """Save a 2x2 folder; rank 0 damages a copy (``_move_a_chunk`` or ``_truncate_without_checksums``),
    then every rank loads it into a fresh model: (the model and optimizer unchanged, the error)."""
    from fsdp_strategy.checkpoint import CheckpointError

    model, optimizer, data_rank = _build(2, 2)
    _train(model, optimizer, 2, data_rank, range(1))
    save_folder(f"{root}/2x2", model, [optimizer], {})
    dist.barrier()
    if rank == 0:
        {"moved": _move_a_chunk, "truncated": _truncate_without_checksums}[damage](Path(root))
    dist.barrier()
    fresh, fresh_optimizer, _ = _build(2, 2, seed=1)
    before = full_state_dict(fresh, rank0_only=False)
    try:
        load_folder(f"{root}/{damage}", fresh, [fresh_optimizer])
        told = "loaded"
    except CheckpointError as error:
        told = str(error)
    after = full_state_dict(fresh, rank0_only=False)
    return all(torch.equal(before[k], after[k]) for k in before) and not fresh_optimizer.state, told


def _move_a_chunk(root: Path) -> None:
    """A copy of ``root/2x2`` whose metadata puts a strided weight's second chunk onto its first (the
    checksums rewritten: the folder is what such a writer writes, not a damaged one)."""
    import json
    import pickle
    import shutil
    import zlib

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    shutil.copytree(root / "2x2", root / "moved")
    with open(root / "moved" / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)
    chunks = metadata.state_dict_metadata["state_dict.layers.0.ff.w1.weight"].chunks
    first, second = sorted(chunks, key=lambda c: tuple(c.offsets))[:2]
    chunks[chunks.index(second)] = ChunkStorageMetadata(offsets=first.offsets, sizes=second.sizes)
    with open(root / "moved" / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    meta = json.loads((root / "moved" / "fsdp_meta.json").read_text())
    meta["checksums"][".metadata"] = zlib.crc32((root / "moved" / ".metadata").read_bytes())
    (root / "moved" / "fsdp_meta.json").write_text(json.dumps(meta))


def _truncate_without_checksums(root: Path) -> None:
    """A copy of ``root/2x2`` as Lightning's ModelParallelStrategy or FSDP2 write it (no ``fsdp_meta.json``:
    no checksums) with one rank's shard file cut to a tenth."""
    import shutil

    shutil.copytree(root / "2x2", root / "truncated")
    (root / "truncated" / "fsdp_meta.json").unlink()
    shard = root / "truncated" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 10])


def test_a_truncated_shard_of_a_folder_without_checksums_changes_nothing(tmp_path):
    """A folder without checksums (ModelParallelStrategy's, FSDP2's) whose shard file was cut short: DCP
    wrote every readable tensor into the shards before failing on the rest. The files are checked
    against the sizes the metadata names first."""
    for unchanged, told in run_ranks(_save_then_load_damaged, 4, tmp_path, str(tmp_path), "truncated"):
        assert unchanged and "__1_0.distcp holds" in told and "nothing was loaded" in told, told


def test_a_folder_whose_chunks_do_not_tile_a_tensor_is_refused_before_anything_loads(tmp_path):
    """A writer's wrong offsets (as torch's uneven strided shards had them, pytorch#168134) would load
    one block twice and leave another unread: every read of the folder refuses it first, naming the
    tensor, and loads nothing."""
    from fsdp_strategy.checkpoint import CheckpointError

    expected = "state_dict.layers.0.ff.w1.weight: its chunks at offsets [0, 0] and [0, 0] overlap"
    for unchanged, told in run_ranks(_save_then_load_damaged, 4, tmp_path, str(tmp_path), "moved"):
        assert unchanged and expected in told and "nothing was loaded" in told, told
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        consolidate(tmp_path / "moved", tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()


def _transposed(rank: int, world: int, root: str) -> dict:
    """A folder of the usual (data_parallel, tensor_parallel) mesh into a model on a (tensor_parallel,
    data_parallel) one (TP the outer dimension: its rows are DTensor's plain Shard(0)), and back."""

    def build(names: tuple[str, str], seed: int):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        torch.manual_seed(seed)
        model = parallelize(TinyLM().double(), mesh["tensor_parallel"])
        shard_model(model, auto_wrap_policy={Block}, process_group=mesh["data_parallel"].get_group())
        return model

    usual, transposed = ("data_parallel", "tensor_parallel"), ("tensor_parallel", "data_parallel")
    model = build(usual, seed=0)
    save_folder(f"{root}/usual", model, [], {})
    want = full_state_dict(model, rank0_only=False)
    into = build(transposed, seed=1)
    load_folder(f"{root}/usual", into, [])
    save_folder(f"{root}/transposed", into, [], {})
    back = build(usual, seed=2)
    load_folder(f"{root}/transposed", back, [])
    return {
        "into": full_state_dict(into, rank0_only=False),
        "back": full_state_dict(back, rank0_only=False),
        "want": want,
    }


def test_a_mesh_with_tensor_parallel_outside_saves_and_loads_its_own_rows(tmp_path):
    """Which placement the rows of a TP Shard(0) weight have depends on the mesh's order: with tensor
    parallel the outer dimension they are DTensor's plain Shard(0) (the strided one loaded another rank's
    block there without a word, and the save failed inside DCP)."""
    for told in run_ranks(_transposed, 4, tmp_path, str(tmp_path)):
        for name, value in told["want"].items():
            assert torch.equal(told["into"][name], value) and torch.equal(told["back"][name], value), name


# ---- Lightning's Trainer: ModelCheckpoint of a 2-D run, resumed in other layouts -------------------------

EPOCH_STEPS, GLOBAL_BATCH = 4, 4  # checkpoints every 2 steps: step 2 inside epoch 0, step 4 at its end


def _lightning_module(fully_shard: bool = False):
    import lightning.pytorch as pl

    class TwoDLM(pl.LightningModule):
        """Lightning's tensor-parallel example made tiny; the plan only where the strategy gives a mesh
        (a plain ``fsdp_custom`` run trains the same model 1-D); with ``fully_shard``, FSDP2 as
        ``ModelParallelStrategy``'s example applies it."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyLM().double()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.device_mesh is None:
                return
            parallelize(self.model, self.device_mesh["tensor_parallel"])
            if fully_shard:
                from torch.distributed.fsdp import fully_shard as shard

                for block in self.model.layers:
                    shard(block, mesh=self.device_mesh["data_parallel"])
                shard(self.model, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            loss = lm_loss(self.model(batch[0]), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    return TwoDLM()


def _fit(root: str, dp: int, tp: int, max_steps: int, ckpt_path: str | None = None, **options) -> dict:
    """A fit at dp x tp (tp 1: plain ``fsdp_custom``; ``options["strategy"] == "model_parallel"``: Lightning's
    ``ModelParallelStrategy`` with FSDP2) with a ModelCheckpoint every 2 steps under ``root``; the losses of
    data-parallel rank 0 and the final weights, whole."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from fsdp_strategy import FSDPCustomStrategy

    kind, layout = options.pop("strategy", "fsdp_custom"), options.pop("layout", "sharded")
    if kind == "model_parallel":
        strategy = pl.strategies.ModelParallelStrategy(dp, tp, save_distributed_checkpoint=layout == "sharded")
    else:
        sizes = {"data_parallel_size": dp, "tensor_parallel_size": tp} if tp > 1 else {}
        strategy = FSDPCustomStrategy(auto_wrap_policy={Block}, state_dict_type=layout, **sizes)
    every = ModelCheckpoint(dirpath=f"{root}/checkpoints", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=dp * tp, strategy=strategy, max_steps=max_steps, callbacks=[every], logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    tokens, targets = zip(*batches(EPOCH_STEPS, GLOBAL_BATCH, seed=1))
    data = DataLoader(TensorDataset(torch.cat(tokens), torch.cat(targets)), batch_size=GLOBAL_BATCH // dp)
    module = _lightning_module(fully_shard=kind == "model_parallel")
    trainer.fit(module, data, ckpt_path=ckpt_path)
    state = module.model.state_dict()
    if kind == "model_parallel":
        weights = {name: value.full_tensor() for name, value in state.items()}
    else:
        weights = {
            name: value.detach().clone() for name, value in full_state_dict(trainer.strategy.model, False).items()
        }
    return {"losses": module.losses, "weights": weights}


def _at(root: str, step: int) -> str:
    """The ModelCheckpoint a fit under ``root`` saved at ``step``."""
    (found,) = Path(root, "checkpoints").glob(f"*-step={step}.ckpt")
    return str(found)


def _trainer_four(rank: int, world: int, root: str) -> dict:
    told = {"A": _fit(f"{root}/A", 2, 2, 6)}  # uninterrupted; its checkpoints: step 2 mid-epoch, 4 at the end
    told["2x2"] = _fit(f"{root}/B", 2, 2, 6, _at(f"{root}/A", 2))
    told["4x1"] = _fit(f"{root}/C", 4, 1, 6, _at(f"{root}/A", 2))
    told["full"] = _fit(f"{root}/D", 2, 2, 4, layout="full")
    told["ours->mps"] = _fit(f"{root}/G", 2, 2, 6, _at(f"{root}/A", 4), strategy="model_parallel")
    told["mps"] = _fit(f"{root}/H", 2, 2, 4, strategy="model_parallel")
    told["mps->2x2"] = _fit(f"{root}/I", 2, 2, 6, _at(f"{root}/H", 4))
    told["mps->4x1"] = _fit(f"{root}/J", 4, 1, 6, _at(f"{root}/H", 4))
    told["mps full"] = _fit(f"{root}/L", 2, 2, 4, strategy="model_parallel", layout="full")
    told["mps full->2x2"] = _fit(f"{root}/M", 2, 2, 6, _at(f"{root}/L", 4))
    return told


def _trainer_two(rank: int, world: int, root: str) -> dict:
    return {
        "1x2": _fit(f"{root}/E", 1, 2, 6, _at(f"{root}/A", 2)),
        "full->1x2": _fit(f"{root}/F", 1, 2, 6, _at(f"{root}/D", 2)),
        "ours->mps 1x2": _fit(f"{root}/K", 1, 2, 6, _at(f"{root}/A", 4), strategy="model_parallel"),
        "ours full->mps 1x2": _fit(f"{root}/N", 1, 2, 6, _at(f"{root}/D", 4), strategy="model_parallel"),
    }


def _named(weights: dict) -> dict:
    return {name.removeprefix("model."): value for name, value in weights.items()}


def test_the_trainer_resumes_a_two_d_run_in_other_layouts_and_with_model_parallel_strategy(tmp_path):
    from test_strategy import LIGHTNING_ENV

    from fsdp_strategy.checkpoint import load_from_checkpoint

    four = run_ranks(_trainer_four, 4, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=600)
    two = run_ranks(_trainer_two, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=600)
    final = _named(four[0]["A"]["weights"])
    assert four[0]["2x2"]["losses"] == pytest.approx(four[0]["A"]["losses"][2:], rel=1e-12, abs=0)
    for told in four + two:
        for key, run in told.items():
            if key in ("A", "full", "mps", "mps full"):
                continue
            weights = _named(run["weights"])
            for name, value in final.items():
                assert torch.allclose(weights[name], value, rtol=1e-9, atol=1e-12), (key, name)
    one = load_from_checkpoint(type(_lightning_module()), _at(f"{tmp_path}/A", 2))  # one process, no group
    full = _named(torch.load(_at(f"{tmp_path}/D", 2), weights_only=True)["state_dict"])
    for name, value in _named(one.state_dict()).items():
        assert torch.equal(value, full[name]), name
