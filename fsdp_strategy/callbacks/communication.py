"""CommunicationMonitor: the engine's collectives per step, from its ledger."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from fsdp_strategy.callbacks.ranks import (
    MIB,
    OptimizerStepWindow,
    RunView,
    check_every,
    due,
    fabric_view,
    log_to_loggers,
    stats_over_ranks,
    trainer_view,
    unwrapped,
)
from fsdp_strategy.engine import get_scheduler, is_sharded
from fsdp_strategy.engine.tensor_parallel_count import TensorParallelCount


class CommunicationMonitor(Callback):
    """Logs, every ``log_every_n_steps`` optimizer steps (at the steps Lightning logs at), the
    collectives of the optimizer step just run, all its micro-batches summed under gradient
    accumulation (fsdp_custom only):

    - per collective kind (``all_gather``, ``reduce_scatter``, ``all_reduce``):
      ``{prefix}/<kind>/calls``, ``wire_mib`` (what this rank sent, ring estimate),
      ``payload_mib`` (size of the buffers), ``busy_s`` (issue to completion) and
      ``bandwidth_mib_s`` (wire MiB / busy seconds, the achieved bandwidth);
    - ``{prefix}/exposed_s/{min,max,mean,max_rank}`` over ranks: the time the training thread
      waited on communication (on gloo; near 0 on NCCL, where waits do not block the host);
    - with ``per_unit``, ``{prefix}/unit/<unit>/<kind>/wire_mib`` and ``.../calls``;
    - with tensor parallel (``tensor_parallel_size`` > 1), tensor parallel's own collectives
      (DTensor's, not the engine's) apart: ``{prefix}/tensor_parallel/<kind>/calls``,
      ``wire_mib`` and ``payload_mib``, kinds ``all_reduce``, ``all_gather``, ``reduce_scatter``,
      ``all_to_all``, ``broadcast``.

    In a Fabric loop, call ``on_fabric_step_start`` / ``on_fabric_step_end`` around each
    optimizer step through ``fabric.call`` (as ``MemoryMonitor``).
    Costs: reading the ledger and one all-gather of one float per logged step; with tensor
    parallel, a logged step's operators each pass through one Python call (a few microseconds:
    [Note: counting tensor parallel's collectives]).
    """

    def __init__(self, log_every_n_steps: int | None = None, per_unit: bool = False, prefix: str = "comm") -> None:
        self.log_every_n_steps = check_every(log_every_n_steps)
        self.per_unit = per_unit
        self.prefix = prefix
        self._logging = False
        self._window = OptimizerStepWindow()
        self._tensor_parallel: TensorParallelCount | None = None  # entered for a logged step of a TP model

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._window.begins(trainer):
            self._logging = due(trainer_view(trainer), self.log_every_n_steps)
            if self._logging and is_sharded(trainer.lightning_module):
                self._count_tensor_parallel(get_scheduler(trainer.lightning_module))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        ledger = getattr(trainer.strategy, "comm_ledger", None)
        if self._window.ends(trainer):
            self._stop_counting()
            if self._logging and ledger is not None:
                self._log(trainer_view(trainer), ledger)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_counting()

    def on_fabric_step_start(self, fabric: Any, model: Any, step: int, **_: Any) -> None:
        """A Fabric loop's optimizer step ``step`` (0 for the first) begins: the ledger counts from here."""
        self._logging = due(fabric_view(fabric, step), self.log_every_n_steps)
        if is_sharded(unwrapped(model)):
            scheduler = get_scheduler(unwrapped(model))
            scheduler.ledger.start_step()
            if self._logging:
                self._count_tensor_parallel(scheduler)

    def on_fabric_step_end(self, fabric: Any, model: Any, step: int, **_: Any) -> None:
        """A Fabric loop's optimizer step ``step`` ended (after ``optimizer.step()``)."""
        self._stop_counting()
        if self._logging and is_sharded(unwrapped(model)):
            self._log(fabric_view(fabric, step), get_scheduler(unwrapped(model)).ledger)

    def _count_tensor_parallel(self, scheduler: Any) -> None:
        self._stop_counting()  # a step that raised in a Fabric loop left it entered
        if scheduler.tensor_parallel:
            self._tensor_parallel = TensorParallelCount(scheduler.ledger)
            self._tensor_parallel.__enter__()

    def _stop_counting(self) -> None:
        if self._tensor_parallel is not None:
            self._tensor_parallel.__exit__(None, None, None)
            self._tensor_parallel = None

    def _log(self, run: RunView, ledger: Any) -> None:
        metrics: dict[str, float] = {}
        exposed = 0.0
        for kind, totals in ledger.current.items():
            base = f"{self.prefix}/{kind}"
            metrics[f"{base}/calls"] = float(totals.calls)
            metrics[f"{base}/wire_mib"] = totals.wire_bytes / MIB
            metrics[f"{base}/payload_mib"] = totals.payload_bytes / MIB
            metrics[f"{base}/busy_s"] = totals.busy_seconds
            if totals.busy_seconds > 0:
                metrics[f"{base}/bandwidth_mib_s"] = totals.wire_bytes / MIB / totals.busy_seconds
            exposed += totals.exposed_seconds
        for kind, totals in ledger.tensor_parallel.items():
            base = f"{self.prefix}/tensor_parallel/{kind}"
            metrics[f"{base}/calls"] = float(totals.calls)
            metrics[f"{base}/wire_mib"] = totals.wire_bytes / MIB
            metrics[f"{base}/payload_mib"] = totals.payload_bytes / MIB
        if self.per_unit:
            for unit, kinds in ledger.per_unit.items():
                for kind, totals in kinds.items():
                    metrics[f"{self.prefix}/unit/{unit}/{kind}/wire_mib"] = totals.wire_bytes / MIB
                    metrics[f"{self.prefix}/unit/{unit}/{kind}/calls"] = float(totals.calls)
        stats = stats_over_ranks(run, {"exposed_s": exposed})
        metrics.update({f"{self.prefix}/{name}": value for name, value in stats.items()})
        log_to_loggers(run, metrics)
