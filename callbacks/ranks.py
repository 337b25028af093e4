"""Helpers shared by the monitors: Lightning's logging cadence, optimizer-step windows,
statistics over ranks, logging."""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl
import torch
import torch.distributed as dist

MIB = 2**20


def lightning_step(trainer: pl.Trainer) -> int:
    """The step Lightning's loggers write training metrics at (batches that ended in an optimizer
    step so far), so that the monitors' values carry the same ``trainer/global_step`` as ``self.log`` values."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def due(trainer: pl.Trainer, every_n_steps: int | None) -> bool:
    """Whether Lightning logs training metrics at this step (its ``log_every_n_steps`` rule:
    W&B steps n-1, 2n-1, ...), with the monitor's own ``every_n_steps`` or, None, the Trainer's."""
    every = trainer.log_every_n_steps if every_n_steps is None else every_n_steps
    return (lightning_step(trainer) + 1) % every == 0


def check_every(log_every_n_steps: int | None) -> int | None:
    """A monitor's ``log_every_n_steps``: None (the Trainer's) or a positive int."""
    if log_every_n_steps is not None and (
        isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
    ):
        raise ValueError(f"log_every_n_steps={log_every_n_steps!r} must be a positive int, or None for the Trainer's")
    return log_every_n_steps


class OptimizerStepWindow:
    """Tells which batches begin and end an optimizer step: with ``accumulate_grad_batches=k``
    a step spans ``k`` micro-batches, and the monitors report once per step, micro-batches summed."""

    def __init__(self) -> None:
        self._global_step_at_begin: int | None = None

    def begins(self, trainer: pl.Trainer) -> bool:
        """Call at batch start: whether this batch is the first of an optimizer step."""
        if self._global_step_at_begin is not None:
            return False
        self._global_step_at_begin = trainer.global_step
        return True

    def ends(self, trainer: pl.Trainer) -> bool:
        """Call at batch end: whether an optimizer stepped in this batch (the step is complete)."""
        ended = self._global_step_at_begin is not None and trainer.global_step != self._global_step_at_begin
        if ended:
            self._global_step_at_begin = None
        return ended


def stats_over_ranks(trainer: pl.Trainer, values: Mapping[str, float]) -> dict[str, float]:
    """``{name/min, name/max, name/mean, name/max_rank}`` of each value over all ranks.

    Costs: one all-gather of ``len(values)`` floats. Every rank must call it.
    """
    local = torch.tensor(list(values.values()), dtype=torch.float64, device=trainer.strategy.root_device)
    if dist.is_available() and dist.is_initialized():
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)  # not strategy.all_gather: Lightning's goes through a deprecated autograd op
        local = torch.stack(rows)
    table = local.reshape(-1, len(values)).cpu()
    out: dict[str, float] = {}
    for column, name in enumerate(values):
        column_values = table[:, column]
        out[f"{name}/min"] = column_values.min().item()
        out[f"{name}/max"] = column_values.max().item()
        out[f"{name}/mean"] = column_values.mean().item()
        out[f"{name}/max_rank"] = float(column_values.argmax().item())
    return out


def log_to_loggers(trainer: pl.Trainer, metrics: Mapping[str, float]) -> None:
    """Send metrics to every logger of the Trainer at Lightning's step (loggers write on rank 0)."""
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=lightning_step(trainer))
