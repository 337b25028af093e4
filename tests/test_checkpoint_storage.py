"""Where checkpoints go: fsspec URLs as Lightning resolves them (``memory://``,
``file://``), saves that never delete what is not a checkpoint, and replacement with no moment
where ``ckpt_path="last"`` finds no complete checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest
import torch
from dist_utils import run_ranks
from fsspec.implementations.memory import MemoryFileSystem
from lightning.pytorch.callbacks import Callback
from test_lightning_checkpoints import _fsdp, _run
from test_strategy import LIGHTNING_ENV

from fsdp_strategy.checkpoint import layout, storage


def _memory_body(rank: int, world: int, local: str) -> dict:
    result = {}
    for kind in ("full", "sharded"):
        root = f"memory://runs/{kind}"
        uninterrupted, _ = _run(world, Path(local), _fsdp(kind), 6, saving_to=root)
        fs = fsspec.filesystem("memory")
        result[f"{kind}_files"] = sorted(Path(p).name for p in fs.ls(f"/runs/{kind}", detail=False))
        resumed, _ = _run(world, Path(local), _fsdp(kind), 6, ckpt_path=f"{root}/epoch=0-step=4.ckpt")
        result[kind] = (uninterrupted[4:], resumed)
        result[f"{kind}_is_sharded"] = layout.is_sharded_checkpoint(f"{root}/epoch=0-step=4.ckpt")
    return result


def test_checkpoints_save_to_and_resume_from_fsspec_memory(tmp_path):
    result = run_ranks(_memory_body, 1, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]  # per process
    for kind in ("full", "sharded"):
        assert result[f"{kind}_files"] == ["epoch=0-step=4.ckpt"]  # nothing on the local disk, no leftovers
        uninterrupted, resumed = result[kind]
        assert resumed == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6), kind
    assert result["sharded_is_sharded"] and not result["full_is_sharded"]
    assert not Path("memory:").exists() and not Path("runs").exists()
    assert not [p for p in tmp_path.rglob("*.ckpt")]  # nothing landed on the local disk


class _SaveAt(Callback):
    """``trainer.save_checkpoint(url)`` after step ``step``, as ModelCheckpoint would save there."""

    def __init__(self, url: str, step: int) -> None:
        self.url, self.step = url, step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.url)


def _file_url_body(rank: int, world: int, root: str) -> dict:
    # Lightning's ModelCheckpoint itself turns a file:// dirpath into a relative folder named
    # "file:" (os.path.realpath), so the URL goes to trainer.save_checkpoint directly
    result = {}
    uninterrupted, _ = _run(world, Path(root) / "u", _fsdp(), 6)
    for kind in ("full", "sharded"):
        url = f"file://{root}/{kind}/step4.ckpt"
        _run(world, Path(root) / kind, _fsdp(kind), 4, callbacks=[_SaveAt(url, 4)])
        resumed, _ = _run(world, Path(root) / f"{kind}_resumed", _fsdp(kind), 6, ckpt_path=url)
        result[kind] = (uninterrupted[4:], resumed)
    return result


def test_checkpoints_save_to_and_resume_from_file_urls_on_two_ranks(tmp_path):
    result = run_ranks(_file_url_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    for kind in ("full", "sharded"):
        uninterrupted, resumed = result[kind]
        assert resumed == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6), kind
    assert layout.is_sharded_checkpoint(tmp_path / "sharded" / "step4.ckpt")
    assert (tmp_path / "full" / "step4.ckpt").is_file()


def _refusal_body(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    _, trainer = _run(world, root / "run", _fsdp("full"), 4)
    errors = {}
    for kind in ("full", "sharded"):
        trainer.strategy._state_dict_type = kind
        for target in ("user_folder", "user_file"):
            try:
                trainer.save_checkpoint(root / target)
            except (IsADirectoryError, FileExistsError) as error:
                errors[(kind, target)] = (type(error).__name__, str(error))
    # replacing our own checkpoints, file <-> folder, leaves just the new one
    for kind in ("sharded", "full", "sharded"):
        trainer.strategy._state_dict_type = kind
        trainer.save_checkpoint(root / "ours.ckpt")
    try:
        trainer.save_checkpoint(root / "other.ckpt", storage_options={"anon": True})
    except TypeError as error:
        errors["storage_options"] = str(error)
    return errors


def test_saves_never_delete_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "user_folder").mkdir()
    (tmp_path / "user_folder" / "notes.txt").write_text("mine")
    (tmp_path / "user_file").write_text("also mine")
    errors = run_ranks(_refusal_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    assert errors[("full", "user_folder")][0] == "IsADirectoryError"  # as Lightning's strategies
    assert errors[("sharded", "user_folder")][0] == "FileExistsError"
    assert "notes.txt" in errors[("sharded", "user_folder")][1]
    assert errors[("full", "user_file")][0] == errors[("sharded", "user_file")][0] == "FileExistsError"
    assert (tmp_path / "user_folder" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "user_file").read_text() == "also mine"
    assert layout.is_sharded_checkpoint(tmp_path / "ours.ckpt")
    left = sorted(p for p in os.listdir(tmp_path) if not p.startswith("rendezvous"))
    assert left == ["ours.ckpt", "run", "user_file", "user_folder"]  # no temporary or replaced leftovers
    assert "storage_options" in errors["storage_options"] and "sharded" in errors["storage_options"]


class _ObservedMemory(MemoryFileSystem):
    """The memory filesystem, noting after every move which names Lightning's ckpt_path="last"
    would find in /ckpts, and whether each holds a complete checkpoint (a file named "complete")."""

    moves: list[list[str]] = []

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        found = [
            Path(p).name
            for p in self.ls("/ckpts", detail=False)
            if Path(p).suffix == ".ckpt" and Path(p).stem.startswith("last") and self.exists(f"{p}/complete")
        ]
        self.moves.append(found)


def _folder(loc: storage.Location, tag: str) -> None:
    storage.makedirs(loc)
    with loc.fs.open(loc.child(tag).path, "wb") as handle:
        handle.write(b"x")
    with loc.fs.open(loc.child("complete").path, "wb") as handle:
        handle.write(b"x")


def test_replacing_a_folder_checkpoint_always_leaves_one_last_can_find(tmp_path):
    # a filesystem without atomic folder exchange (an object store): the old one is moved aside
    # under a name ckpt_path="last" still finds, then the new one moves in, then the old is deleted
    fs = _ObservedMemory()
    final = storage.Location(fs, "/ckpts/last.ckpt", "memory://ckpts/last.ckpt")
    _folder(final, "old")
    temporary = storage.temporary(final)
    _folder(temporary, "new")
    storage.commit(temporary, final)
    assert all(found for found in _ObservedMemory.moves)  # after every move some last*.ckpt is complete
    assert fs.exists("/ckpts/last.ckpt/new") and fs.ls("/ckpts", detail=False) == ["/ckpts/last.ckpt"]

    # a local disk: one atomic exchange, then the old one (now under the temporary name) is deleted
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "in_a").touch()
    assert storage._exchange(str(tmp_path / "a"), str(tmp_path / "b"))  # renameat2 works on this system
    assert os.listdir(tmp_path / "b") == ["in_a"] and os.listdir(tmp_path / "a") == []
    os.rmdir(tmp_path / "a")
    (tmp_path / "b" / "in_a").unlink()
    os.rmdir(tmp_path / "b")
    local = storage.locate(tmp_path / "last.ckpt")
    _folder(local, "old")
    temporary = storage.temporary(local)
    _folder(temporary, "new")
    inode = os.stat(temporary.path).st_ino
    storage.commit(temporary, local)
    assert os.stat(local.path).st_ino == inode and sorted(os.listdir(local.path)) == ["complete", "new"]
    assert os.listdir(tmp_path) == ["last.ckpt"]
    torch.save({"a": 1}, tmp_path / "file.ckpt")  # a file replaced by a file: one rename
    replacement = storage.temporary(storage.locate(tmp_path / "file.ckpt"))
    torch.save({"a": 2}, replacement.path)
    storage.commit(replacement, storage.locate(tmp_path / "file.ckpt"))
    assert torch.load(tmp_path / "file.ckpt") == {"a": 2}
