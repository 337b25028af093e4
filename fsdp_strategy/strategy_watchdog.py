"""RunWatchdog: the part of each strategy (Trainer and Fabric) that runs the watchdog of a
Lightning run: one watchdog per run, exceptions reported at once, and Lightning's barrier,
broadcast and reduce watched ([Note: watchdog] in engine/watchdog.py).

A part the strategies own (as ``DeferredRequeue`` and the ``CheckpointWriter`` are), given what it
needs as arguments: it reads no attribute of the strategy.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn

from fsdp_strategy.checkpoint.writer import CheckpointWriter
from fsdp_strategy.engine import get_scheduler, is_sharded
from fsdp_strategy.engine.monitoring import watched
from fsdp_strategy.engine.watchdog import CollectiveError, Watchdog
from fsdp_strategy.sync_batchnorm import SyncBatchNorm


class RunWatchdog:
    """The watchdog of a strategy's runs. ``dog`` is this run's watchdog (None between runs); the
    checkpoint ``writer`` is told it, so a save's agreements are watched. Costs: a thread per run
    (the watchdog's) and nothing per step beyond what the engine's collectives report."""

    def __init__(self, writer: CheckpointWriter) -> None:
        self.dog: Watchdog | None = None
        self._writer = writer

    def start(self, collective_timeout: float, node_rank: int, dump_dir: str | None) -> None:
        """One watchdog per run (a failure a script caught is not reported again); a failed one is
        kept, so that this process's collectives raise at once: it cannot run another job. A failing
        rank writes its flight recorder ring into ``dump_dir`` (the working folder where None)."""
        if self.dog is None:
            self.dog = Watchdog.start(collective_timeout, node_rank, False, dump_dir=dump_dir)
        self._writer.watchdog = self.dog

    def attach(self, model: nn.Module, dog: Watchdog | None) -> None:
        """Let ``dog`` (this run's, or None after it) watch the sharded ``model``'s collectives and
        its SyncBatchNorm layers."""
        get_scheduler(model).observer.attach(dog)
        for layer in model.modules():
            if isinstance(layer, SyncBatchNorm):
                layer.watchdog = dog

    def close(self, models: list[nn.Module]) -> None:
        """Close the sharded ``models``' hooks and threads (every rank does, at the end of a run:
        a change of the last step that a lower ``param_dtype`` could not keep is raised on every
        rank), then the run's watchdog; nothing stays installed (a watchdog whose collective
        failed stays: it ends the process)."""
        try:
            for model in models:
                if is_sharded(model):
                    try:
                        get_scheduler(model).close(agree=True)
                    finally:
                        self.attach(model, None)
        finally:
            if self.dog is not None and self.dog.error is None:
                self.dog.close()
                self.dog = self._writer.watchdog = None

    @contextmanager
    def reported(self) -> Generator[None, None, None]:
        """Report an exception of a step or a backward at once ([Note: watchdog]): Lightning's
        ``on_exception`` callbacks run before the strategy's, and may wait in a collective (a
        checkpoint on exception) that the other ranks, not told, would never join."""
        try:
            yield
        except BaseException as error:
            self.report_exception(error)
            self._name_lost_peer(error)
            raise

    def _name_lost_peer(self, error: BaseException) -> None:
        """A collective the engine does not issue (tensor parallel's inside a forward, the user's
        own) fails with torch's bare error when a peer dies ("Connection reset by peer"): where a
        rank of this host has exited, that error becomes the ``CollectiveError`` naming it and where
        every rank was, as the engine's own collectives raise. Costs: nothing until an error."""
        dog = self.dog
        if dog is None or not isinstance(error, RuntimeError) or isinstance(error, CollectiveError):
            return
        dog.reports.learn_identities()
        if dog.reports.gone_locally():
            text = f"{type(error).__name__}: {str(error).strip()[:300]}"
            dog.fail(None, f"a collective outside the engine (tensor parallel, the user's own) failed: {text}", error)

    def report_exception(self, error: BaseException) -> None:
        """Publish ``error`` to the other ranks (not SIGTERMException: raised on every rank at one step)."""
        if self.dog is not None and not isinstance(error, SIGTERMException):
            self.dog.report_exception(error)

    def barrier(self, name: str | None, device: torch.device) -> None:
        """Wait for every rank, watched (device-aware on NCCL: ``device`` is this rank's)."""
        if not _distributed_is_initialized():
            return
        with watched("barrier", name or "Lightning", self.dog):
            if torch.distributed.get_backend() == "nccl":
                torch.distributed.barrier(device_ids=[device.index])
            else:
                torch.distributed.barrier()

    def broadcast(self, obj: TBroadcast, src: int) -> TBroadcast:
        """Rank ``src``'s ``obj`` on every rank (pickled), watched."""
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        with watched("broadcast", "Lightning", self.dog):
            torch.distributed.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    def reduce(self, tensor: Tensor | Any, group: Any, reduce_op: ReduceOp | str | None) -> Tensor | Any:
        """Lightning's reduce of a tensor over ``group``, watched; anything else is returned as it is."""
        if isinstance(tensor, Tensor):
            with watched("all_reduce", "Lightning", self.dog):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
