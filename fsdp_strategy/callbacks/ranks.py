"""Helpers shared by the monitors: what they read of a run (a Trainer's or a Fabric loop's),
Lightning's logging cadence, optimizer-step windows, statistics over ranks, logging."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.wrappers import _unwrap_objects

MIB = 2**20
FABRIC_LOG_EVERY_N_STEPS = 50  # a Fabric loop has no cadence of its own: the Trainer's default


@dataclass(frozen=True)
class RunView:
    """What a monitor reads of a run at one optimizer step, from a Trainer (``trainer_view``) or a
    Fabric loop (``fabric_view``): the same monitors serve both."""

    device: torch.device
    world_size: int
    log_step: int  # the step this step's metrics are logged at
    log_every: int  # the cadence of a monitor given none
    loggers: list
    optimizers: list
    precision: Any  # the precision plugin (its compute dtype)


def trainer_view(trainer: pl.Trainer) -> RunView:
    """A Trainer's run: Lightning's logging step and ``log_every_n_steps``, its loggers and optimizers."""
    strategy = trainer.strategy
    return RunView(
        strategy.root_device,
        trainer.world_size,
        lightning_step(trainer),
        trainer.log_every_n_steps,
        list(trainer.loggers),
        list(trainer.optimizers),
        strategy.precision_plugin,
    )


def fabric_view(fabric: Any, step: int, optimizers: Any = ()) -> RunView:
    """A Fabric loop's run at optimizer step ``step`` (0 for the first), logging to ``fabric.loggers``."""
    return RunView(
        fabric.device,
        fabric.world_size,
        step,
        FABRIC_LOG_EVERY_N_STEPS,
        list(fabric.loggers),
        [_unwrap_objects(optimizer) for optimizer in optimizers],
        fabric.strategy.precision,
    )


def unwrapped(model: Any) -> Any:
    """The module Fabric's ``setup`` wrapped (the model itself under the Trainer)."""
    return _unwrap_objects(model)


def lightning_step(trainer: pl.Trainer) -> int:
    """The step Lightning's loggers write training metrics at (batches that ended in an optimizer
    step so far), so that the monitors' values carry the same ``trainer/global_step`` as ``self.log`` values."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def due(run: RunView, every_n_steps: int | None) -> bool:
    """Whether Lightning logs training metrics at this step (its ``log_every_n_steps`` rule:
    W&B steps n-1, 2n-1, ...), with the monitor's own ``every_n_steps`` or, None, the run's."""
    every = run.log_every if every_n_steps is None else every_n_steps
    return (run.log_step + 1) % every == 0


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


def stats_over_ranks(run: RunView, values: Mapping[str, float]) -> dict[str, float]:
    """``{name/min, name/max, name/mean, name/max_rank}`` of each value over all ranks.

    Costs: one all-gather of ``len(values)`` floats. Every rank must call it.
    """
    local = torch.tensor(list(values.values()), dtype=torch.float64, device=run.device)
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


def log_to_loggers(run: RunView, metrics: Mapping[str, float]) -> None:
    """Send metrics to every logger of the run at its logging step (loggers write on rank 0)."""
    for logger in run.loggers:
        logger.log_metrics(dict(metrics), step=run.log_step)
