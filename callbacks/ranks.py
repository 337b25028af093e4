"""Helpers shared by the monitors: every-n-steps cadence, statistics over ranks, logging."""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl
import torch

MIB = 2**20


def due(trainer: pl.Trainer, every_n_steps: int) -> bool:
    """Whether the optimizer step about to run is one to log (steps 0, n, 2n, ...)."""
    return trainer.global_step % every_n_steps == 0


def stats_over_ranks(trainer: pl.Trainer, values: Mapping[str, float]) -> dict[str, float]:
    """``{name/min, name/max, name/mean, name/max_rank}`` of each value over all ranks.

    Costs: one all-gather of ``len(values)`` floats. Every rank must call it.
    """
    local = torch.tensor(list(values.values()), dtype=torch.float64, device=trainer.strategy.root_device)
    gathered = trainer.strategy.all_gather(local)
    table = gathered.reshape(-1, len(values)).cpu()
    out: dict[str, float] = {}
    for column, name in enumerate(values):
        column_values = table[:, column]
        out[f"{name}/min"] = column_values.min().item()
        out[f"{name}/max"] = column_values.max().item()
        out[f"{name}/mean"] = column_values.mean().item()
        out[f"{name}/max_rank"] = float(column_values.argmax().item())
    return out


def log_to_loggers(trainer: pl.Trainer, metrics: Mapping[str, float]) -> None:
    """Send metrics to every logger of the Trainer at the current step (loggers write on rank 0)."""
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=trainer.global_step)
