"""CheckpointWriter: writes checkpoints atomically, in the foreground or in the background.

Every write goes to a temporary name and is committed by rank 0 once all ranks are done (see
[Note: atomic commit] in storage.py), on a local disk or any fsspec filesystem. With
``async_save`` a sharded save stages the shards to CPU memory, returns, and writes on a
background thread that talks over its own gloo process group (so its collectives never
interleave with training's); the next save, a removal, a load or the end of training waits for
it. Costs of async: a CPU copy of this rank's shards while it is written.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_strategy.checkpoint import layout, sharded, storage
from fsdp_strategy.checkpoint.storage import Location
from fsdp_strategy.engine import control
from fsdp_strategy.engine.view import ShardsView

log = logging.getLogger(__name__)
Where = str | os.PathLike | Location


def _is_rank0() -> bool:
    return control.process_rank()[0] == 0


class CheckpointWriter:
    """Saves one checkpoint at a time; ``wait()`` blocks until the last one is committed."""

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self.watchdog: Any = None  # the strategy's: watches the agreements of a save ([Note: watchdog])
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def setup(self) -> None:
        """Create the background writer's own process group (a collective: every rank calls it),
        released by ``teardown`` or, for a save after the end of a run, at interpreter exit."""
        if self.async_save and self._group is None:
            self._group = control.new_gloo_group()
            atexit.register(self._release)

    def _release(self) -> None:
        """Finish the save in flight and destroy the background group while the interpreter is whole:
        a gloo group left to interpreter shutdown can free its last collective's tensors from a
        worker thread after the interpreter is gone, which aborts a healthy process ("terminate
        called without an active exception"). Registered after the process group's own exit hook
        (Lightning's), so it runs before it."""
        atexit.unregister(self._release)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        control.destroy_group(self._group)
        self._group = None

    @contextmanager
    def in_foreground(self) -> Iterator[None]:
        """Saves inside the block are written and committed before they return, also with
        ``async_save`` (the save before SLURM's requeue: the job ends right after it)."""
        async_save, self.async_save = self.async_save, False
        try:
            yield
        finally:
            self.async_save = async_save

    def wait(self) -> None:
        """Block until the checkpoint being written in the background is committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint save failed: {error}") from error

    def save_full(self, final: Where, temporary: Where, write: Callable[[str], None]) -> None:
        """Rank 0 writes one file with ``write(temporary url)``; committed after every rank arrives."""
        final, temporary = storage.locate(final), storage.locate(temporary)
        self.wait()
        error = None
        if _is_rank0():
            try:
                write(temporary.url)
                if not storage.exists(temporary):  # Lightning's _atomic_save drops a PermissionError
                    raise PermissionError(f"the checkpoint IO wrote nothing at {temporary} (a read-only directory?)")
            except Exception as caught:  # a full disk, a lost bucket: every rank must hear of it
                error = caught
        _agree(error, final, temporary, None, self.watchdog)
        _commit(temporary, final, None, self.watchdog)

    def save_sharded(
        self,
        final: Where,
        temporary: Where,
        module: nn.Module,
        optimizers: list,
        lightning_state: dict,
        extra_tensors: dict | None = None,
        keys: tuple[str, list[str]] | None = None,
    ) -> None:
        """Every rank writes its shards into ``temporary``; rank 0 commits it to ``final``.
        ``extra_tensors``: more DCP keys to write (a weight average's shard views); ``keys``: the
        model's and the optimizers' DCP keys (default: the Trainer's, ``model``, ``optimizer_<i>``)."""
        final, temporary = storage.locate(final), storage.locate(temporary)
        self.wait()
        self.setup()  # a save after the end of training (teardown released the background group)
        error, state = None, None
        try:  # what one rank may fail at alone, agreed before DCP's collectives begin
            storage.makedirs(temporary)
            view = ShardsView.of(module)  # read once for the whole save
            state = {**sharded.prepare_state(view, optimizers, keys), **(extra_tensors or {})}
        except Exception as caught:
            error = caught
        _agree(error, final, temporary, None, self.watchdog)
        if not self.async_save:
            try:
                sharded.write_dcp(temporary, state)
                sharded.finish_folder(temporary, sharded.build_meta(view), lightning_state, None, self.watchdog)
            except (Exception, dcp.CheckpointException) as caught:
                error = caught
            _agree(error, final, temporary, None, self.watchdog)
            _commit(temporary, final, None, self.watchdog)
            return
        meta = sharded.build_meta(view)
        extra = copy.deepcopy(lightning_state)
        planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        future = dcp.async_save(
            state, storage_writer=sharded.dcp_writer(temporary), planner=planner, process_group=self._group
        )
        self._thread = threading.Thread(
            target=self._finish, args=(future, temporary, final, meta, extra), name="fsdp-checkpoint"
        )  # not a daemon: a save begun after training (nothing waits for it) completes before the process exits
        self._thread.start()

    def _finish(self, future: Any, temporary: Location, final: Location, meta: dict, extra: dict) -> None:
        try:
            error = None
            try:
                (future.upload_completion if hasattr(future, "upload_completion") else future).result()
                sharded.finish_folder(temporary, meta, extra, self._group)
            except (Exception, dcp.CheckpointException) as caught:
                error = caught
            _agree(error, final, temporary, self._group)
            _commit(temporary, final, self._group)
        except BaseException as error:  # noqa: BLE001 - reported by the next wait()
            log.error("background checkpoint save to %s failed: %s", final, error)
            self._error = error

    def remove(self, path: Where) -> None:
        """Delete a checkpoint (file or folder) on rank 0, after any save in flight."""
        self.wait()
        if _is_rank0():
            storage.remove(storage.locate(path))

    def teardown(self) -> None:
        """Finish the save in flight and release the background process group."""
        self.wait()
        self._release()


def save_targets(
    filepath: Where, state_dict_type: str, is_global_zero: bool, broadcast: Any
) -> tuple[Location, Location]:
    """The final and temporary names of a save, decided by rank 0 with whether the save may replace
    what is there (``refuse_to_replace``), in one ``broadcast``; a refusal is raised on every rank."""
    decision = None
    if is_global_zero:
        final = storage.locate(filepath)
        try:
            refusal = layout.refuse_to_replace(final, state_dict_type)
        except Exception as error:  # an unreachable filesystem: every rank must hear of it
            refusal = error
        decision = (final.url, storage.temporary(final).url, refusal)
    final_url, temporary_url, refusal = broadcast(decision)
    if refusal is not None:
        raise refusal
    return storage.locate(final_url), storage.locate(temporary_url)


def _agree(
    error: BaseException | None, final: Location, temporary: Location, group: Any = None, dog: Any = None
) -> None:
    """Every rank learns whether any rank failed to write (one all-gather, so no rank is left
    waiting in a barrier); on a failure the partial checkpoint is removed and every rank raises
    ``CheckpointSaveError`` naming the ranks and causes. The previous checkpoint is untouched."""
    rank, _ = control.process_rank(group)
    causes: dict[int, str] = {}
    for report in control.all_gather_objects(None if error is None else _causes(error, rank), group, dog):
        causes.update(report or {})
    if not causes:
        return
    if _is_rank0():
        storage.remove(temporary)
    failures = "; ".join(f"rank {r}: {text}" for r, text in sorted(causes.items()))
    raise layout.CheckpointSaveError(
        f"saving checkpoint {final} failed ({failures}); nothing was written under that name, and a "
        "checkpoint already there is untouched"
    ) from error


def _commit(temporary: Location, final: Location, group: Any = None, dog: Any = None) -> None:
    """Rank 0 moves the checkpoint to its final name; every rank learns whether it could (a
    read-only directory fails here) and raises ``CheckpointSaveError`` if not."""
    error = None
    if _is_rank0():
        try:
            storage.commit(temporary, final)
        except Exception as caught:
            error = caught
    _agree(error, final, temporary, group, dog)


def _causes(error: BaseException, rank: int) -> dict[int, str]:
    """``failing rank -> one line``: DCP's exception carries every failing rank's, with tracebacks we drop."""
    if isinstance(error, dcp.CheckpointException):
        return {r: _line(exc) for r, (exc, _) in error.failures.items()}
    return {rank: _line(error)}


def _line(error: BaseException) -> str:
    chain = [error]
    while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 4:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return " <- ".join(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}" for e in chain)
