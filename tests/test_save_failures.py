"""A save that fails on one rank (a full disk) ends on every rank with an error naming it, leaves
the previous checkpoint under that name loadable and no partial one behind.
The full disk is the local disk behind an fsspec protocol whose writes fail after a byte budget."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import fsspec
import pytest
import torch
from dist_utils import run_ranks
from fsspec.implementations.local import LocalFileSystem
from test_lightning_checkpoints import _fsdp, _run
from test_strategy import LIGHTNING_ENV

from fsdp_strategy.checkpoint import CheckpointSaveError, full_state_dict


class _BudgetedFile:
    """A file whose writes fail with ENOSPC once the process has written ``_FullDisk.budget`` bytes."""

    def __init__(self, handle) -> None:
        self._handle = handle

    def write(self, data) -> int:
        size = len(memoryview(data).cast("B"))
        if _FullDisk.budget is not None:
            if size > _FullDisk.budget:
                raise OSError(errno.ENOSPC, "No space left on device")
            _FullDisk.budget -= size
        return self._handle.write(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._handle.close()


class _FullDisk(LocalFileSystem):
    """The local disk under ``fulldisk://``; ``budget``: bytes this process may still write (None: any)."""

    protocol = ("fulldisk",)
    budget: int | None = None

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("fulldisk://"))

    def _open(self, path, mode="rb", **kwargs):
        handle = super()._open(path, mode, **kwargs)
        return _BudgetedFile(handle) if "w" in mode or "a" in mode else handle


fsspec.register_implementation("fulldisk", _FullDisk, clobber=True)


def _body(rank: int, world: int, root: str, kind: str, failing_rank: int) -> dict:
    url = f"fulldisk://{root}/{kind}.ckpt"
    _, trainer = _run(world, Path(root) / "run", _fsdp(kind), 2)
    trainer.save_checkpoint(url)  # a good checkpoint under the name
    before = full_state_dict(trainer.strategy.model, rank0_only=False)
    _run(world, Path(root) / "more", _fsdp(kind), 3, module=trainer.lightning_module)  # different weights now
    if rank == failing_rank:
        _FullDisk.budget = 64  # this rank's disk is full
    try:
        trainer.save_checkpoint(url)
        error = None
    except CheckpointSaveError as caught:
        error = str(caught)
    _FullDisk.budget = None
    _, resumed = _run(world, Path(root) / "after", _fsdp(kind), 2, ckpt_path=url)
    after = full_state_dict(resumed.strategy.model, rank0_only=False)
    return {"error": error, "same": all(torch.equal(after[k], v) for k, v in before.items())}


@pytest.mark.parametrize(("kind", "failing_rank"), [("full", 0), ("sharded", 1)])
def test_a_full_disk_on_one_rank_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path, kind, failing_rank):
    results = run_ranks(_body, 2, tmp_path, str(tmp_path), kind, failing_rank, env=LIGHTNING_ENV, timeout=200)
    for result in results:  # every rank raises (none waits in a barrier for the failed one)
        assert result["error"] is not None and f"rank {failing_rank}: " in result["error"]
        assert f"rank {1 - failing_rank}: " not in result["error"] and "untouched" in result["error"]
        if kind == "full":  # DCP's torch.save writer turns ENOSPC into "unexpected pos" (torch's wording)
            assert "No space left on device" in result["error"]
        assert result["same"]  # the checkpoint under the name is still the good one, and loads
    assert [p for p in os.listdir(tmp_path) if p.startswith(f".{kind}.ckpt")] == []  # no partial one left


def _read_only_body(rank: int, world: int, root: str, kind: str) -> dict:
    folder = Path(root) / "read_only"
    folder.mkdir(exist_ok=True)
    path = folder / f"{kind}.ckpt"
    _, trainer = _run(world, Path(root) / "run", _fsdp(kind), 2)
    trainer.save_checkpoint(path)
    before = full_state_dict(trainer.strategy.model, rank0_only=False)
    _run(world, Path(root) / "more", _fsdp(kind), 3, module=trainer.lightning_module)
    if rank == 0:
        subprocess.run(["chattr", "+i", str(folder)], check=True)  # read-only even for root
    torch.distributed.barrier()
    try:
        trainer.save_checkpoint(path)
        error = None
    except CheckpointSaveError as caught:
        error = str(caught)
    finally:
        torch.distributed.barrier()
        if rank == 0:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    _, resumed = _run(world, Path(root) / "after", _fsdp(kind), 2, ckpt_path=path)
    after = full_state_dict(resumed.strategy.model, rank0_only=False)
    return {"error": error, "same": all(torch.equal(after[k], v) for k, v in before.items())}


def _can_make_read_only(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    made = subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode == 0
    if made:
        subprocess.run(["chattr", "-i", str(probe)], check=True)
    return made


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_read_only_checkpoint_directory_fails_clearly_and_loses_nothing(tmp_path, kind):
    if shutil.which("chattr") is None or not _can_make_read_only(tmp_path):
        pytest.skip("needs chattr +i (root on a filesystem with the immutable flag) for a directory root cannot write")
    results = run_ranks(_read_only_body, 2, tmp_path, str(tmp_path), kind, env=LIGHTNING_ENV, timeout=200)
    for result in results:  # every rank raises, naming the rank, the cause and the checkpoint
        assert result["error"] is not None and "PermissionError" in result["error"], result["error"]
        assert f"{kind}.ckpt" in result["error"] and "untouched" in result["error"]
        assert result["same"]  # the previous checkpoint under the name loads
