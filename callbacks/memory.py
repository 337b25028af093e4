"""MemoryMonitor: per-rank memory, aggregated over ranks, every ``log_every_n_steps`` steps (default: the Trainer's)."""

from __future__ import annotations

import resource
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
from fsdp_strategy.callbacks.ranks import MIB, OptimizerStepWindow, check_every, due, log_to_loggers, stats_over_ranks
from lightning.pytorch.callbacks import Callback

from fsdp_strategy.engine import get_scheduler, is_sharded


class MemoryMonitor(Callback):
    """Logs, every ``log_every_n_steps`` optimizer steps (at the steps Lightning logs at), as
    ``{prefix}/<name>/{min,max,mean,max_rank}`` over all ranks (MiB unless a count):

    - CUDA: ``cuda_allocated_peak``, ``cuda_reserved_peak`` (in the step), ``cuda_alloc_retries``,
      ``cuda_ooms``; CPU: ``rss`` and ``rss_peak`` (of the process);
    - the engine's accounting (fsdp_custom only): ``sharded_params``, ``sharded_grads``,
      ``optimizer_state``, ``gathered_now`` and ``gathered_peak`` (full parameters alive now, and
      at most during the step).

    ``max_rank`` names the rank holding the max, so a straggler or a leaking rank stands out.
    Costs: one all-gather of about ten floats per logged step; nothing on other steps.
    """

    def __init__(self, log_every_n_steps: int | None = None, prefix: str = "memory") -> None:
        self.log_every_n_steps = check_every(log_every_n_steps)
        self.prefix = prefix
        self._logging = False
        self._window = OptimizerStepWindow()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if not self._window.begins(trainer):
            return
        self._logging = due(trainer, self.log_every_n_steps)
        if not self._logging:
            return
        if is_sharded(pl_module):
            get_scheduler(pl_module).memory.reset_peak()
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if not self._window.ends(trainer) or not self._logging:
            return
        stats = stats_over_ranks(trainer, self.read(trainer, pl_module))
        log_to_loggers(trainer, {f"{self.prefix}/{name}": value for name, value in stats.items()})

    def read(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """This rank's readings (the values before aggregation)."""
        device = trainer.strategy.root_device
        values: dict[str, float] = {}
        if device.type == "cuda":
            cuda = torch.cuda.memory_stats(device)
            values["cuda_allocated_peak"] = cuda.get("allocated_bytes.all.peak", 0) / MIB
            values["cuda_reserved_peak"] = cuda.get("reserved_bytes.all.peak", 0) / MIB
            values["cuda_alloc_retries"] = float(cuda.get("num_alloc_retries", 0))
            values["cuda_ooms"] = float(cuda.get("num_ooms", 0))
        values["rss"] = psutil.Process().memory_info().rss / MIB
        values["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB
        if is_sharded(pl_module):
            scheduler = get_scheduler(pl_module)
            sharded = scheduler.sharded_bytes()
            values["sharded_params"] = sharded["params"] / MIB
            values["sharded_grads"] = sharded["grads"] / MIB
            values["optimizer_state"] = _optimizer_bytes(trainer) / MIB
            values["gathered_now"] = scheduler.memory.current / MIB
            values["gathered_peak"] = scheduler.memory.peak / MIB
        return values


def _optimizer_bytes(trainer: pl.Trainer) -> int:
    return sum(
        value.numel() * value.element_size()
        for optimizer in trainer.optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )
