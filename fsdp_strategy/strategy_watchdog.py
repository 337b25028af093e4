"""The strategies' watchdog hooks: one watchdog per run, exceptions reported at once, and
Lightning's barrier, broadcast and reduce watched ([Note: watchdog] in engine/watchdog.py).

A mixin of ``FSDPCustomStrategy`` and ``FSDPCustomFabricStrategy`` (kept apart so the strategy
modules stay about Lightning's plumbing); it uses the strategy's model, writer and
collective_timeout.
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
from torch import Tensor

from fsdp_strategy.engine import get_scheduler, is_sharded
from fsdp_strategy.engine.monitoring import watched
from fsdp_strategy.engine.watchdog import Watchdog
from fsdp_strategy.sync_batchnorm import SyncBatchNorm


class WatchdogHooks:
    """The watchdog's life in a Lightning run, for ``FSDPCustomStrategy``."""

    _watchdog: Watchdog | None

    def _start_watchdog(self) -> None:
        """One watchdog per run (a failure a script caught is not reported again); a failed one is
        kept, so that this process's collectives raise at once: it cannot run another job."""
        if self._watchdog is None:
            module = getattr(self, "lightning_module", None)  # Fabric's strategy has none
            trainer = module._trainer if module is not None else None
            root = trainer.default_root_dir if trainer is not None else None  # failing ranks' rings go there
            self._watchdog = Watchdog.start(self.collective_timeout, self.node_rank, False, dump_dir=root)
        self._writer.watchdog = self._watchdog

    def _attach_watchdog(self, dog: Watchdog | None) -> None:
        """Let ``dog`` (this run's, or None after it) watch the sharded model's collectives and its
        SyncBatchNorm layers."""
        get_scheduler(self.model).observer.attach(dog)
        for layer in self.model.modules():
            if isinstance(layer, SyncBatchNorm):
                layer.watchdog = dog

    def _close_watchdog(self) -> None:
        """Close the engine's hooks and threads and the run's watchdog; nothing stays installed (a
        watchdog whose collective failed stays: it ends the process)."""
        if self.model is not None and is_sharded(self.model):
            get_scheduler(self.model).close()
            self._attach_watchdog(None)
        if self._watchdog is not None and self._watchdog.error is None:
            self._watchdog.close()
            self._watchdog = self._writer.watchdog = None

    @contextmanager
    def _reported(self) -> Generator[None, None, None]:
        """Report an exception of a step or a backward at once ([Note: watchdog]): Lightning's
        ``on_exception`` callbacks run before the strategy's, and may wait in a collective (a
        checkpoint on exception) that the other ranks, not told, would never join."""
        try:
            yield
        except BaseException as error:
            self._report_exception(error)
            raise

    def _report_exception(self, error: BaseException) -> None:
        """Publish ``error`` to the other ranks (not SIGTERMException: raised on every rank at one step)."""
        if self._watchdog is not None and not isinstance(error, SIGTERMException):  # raised on every rank in step
            self._watchdog.report_exception(error)

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (device-aware on NCCL)."""
        if not _distributed_is_initialized():
            return
        with watched("barrier", name or "Lightning", self._watchdog):
            if torch.distributed.get_backend() == "nccl":
                torch.distributed.barrier(device_ids=[self.root_device.index])
            else:
                torch.distributed.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        with watched("broadcast", "Lightning", self._watchdog):
            torch.distributed.broadcast_object_list(container, src, group=_group.WORLD)
        return container[0]

    def reduce(self, tensor: Tensor | Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            with watched("all_reduce", "Lightning", self._watchdog):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
