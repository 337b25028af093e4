"""CommunicationMonitor: the engine's collectives per step, from its ledger."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from fsdp_strategy.callbacks.ranks import MIB, OptimizerStepWindow, check_every, due, log_to_loggers, stats_over_ranks
from lightning.pytorch.callbacks import Callback


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
    - with ``per_unit``, ``{prefix}/unit/<unit>/<kind>/wire_mib`` and ``.../calls``.

    Costs: reading the ledger and one all-gather of one float per logged step.
    """

    def __init__(self, log_every_n_steps: int | None = None, per_unit: bool = False, prefix: str = "comm") -> None:
        self.log_every_n_steps = check_every(log_every_n_steps)
        self.per_unit = per_unit
        self.prefix = prefix
        self._logging = False
        self._window = OptimizerStepWindow()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._window.begins(trainer):
            self._logging = due(trainer, self.log_every_n_steps)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        ledger = getattr(trainer.strategy, "comm_ledger", None)
        if not self._window.ends(trainer) or not self._logging or ledger is None:
            return
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
        if self.per_unit:
            for unit, kinds in ledger.per_unit.items():
                for kind, totals in kinds.items():
                    metrics[f"{self.prefix}/unit/{unit}/{kind}/wire_mib"] = totals.wire_bytes / MIB
                    metrics[f"{self.prefix}/unit/{unit}/{kind}/calls"] = float(totals.calls)
        stats = stats_over_ranks(trainer, {"exposed_s": exposed})
        metrics.update({f"{self.prefix}/{name}": value for name, value in stats.items()})
        log_to_loggers(trainer, metrics)
