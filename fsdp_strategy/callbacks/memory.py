"""MemoryMonitor: per-rank memory, aggregated over ranks, every ``log_every_n_steps`` steps (default: the Trainer's)."""

from __future__ import annotations

import resource
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
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


class MemoryMonitor(Callback):
    """Logs, every ``log_every_n_steps`` optimizer steps (at the steps Lightning logs at), as
    ``{prefix}/<name>/{min,max,mean,max_rank}`` over all ranks (MiB unless a count):

    - CUDA: ``cuda_allocated_peak``, ``cuda_reserved_peak`` (in the step), ``cuda_alloc_retries``,
      ``cuda_ooms``; CPU: ``rss`` and ``rss_peak`` (of the process);
    - the engine's accounting (fsdp_custom only): ``sharded_params``, ``sharded_grads``,
      ``optimizer_state``, ``gathered_now`` and ``gathered_peak`` (full parameters alive now, and
      at most during the step).

    ``max_rank`` names the rank holding the max, so a straggler or a leaking rank stands out.
    In a Fabric loop, pass it to ``Fabric(callbacks=[...])`` and call
    ``fabric.call("on_fabric_step_start", ...)`` / ``fabric.call("on_fabric_step_end", ...)``
    around each optimizer step (its default cadence there: every 50 steps).
    Costs: one all-gather of about ten floats per logged step; nothing on other steps.
    """

    def __init__(self, log_every_n_steps: int | None = None, prefix: str = "memory") -> None:
        self.log_every_n_steps = check_every(log_every_n_steps)
        self.prefix = prefix
        self._logging = False
        self._window = OptimizerStepWindow()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._window.begins(trainer):
            self._begin(trainer_view(trainer), pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self._window.ends(trainer):
            self._end(trainer_view(trainer), pl_module)

    def on_fabric_step_start(self, fabric: Any, model: Any, step: int, **_: Any) -> None:
        """A Fabric loop's optimizer step ``step`` (0 for the first) begins."""
        self._begin(fabric_view(fabric, step), unwrapped(model))

    def on_fabric_step_end(self, fabric: Any, model: Any, step: int, optimizers: Any = (), **_: Any) -> None:
        """A Fabric loop's optimizer step ``step`` ended (after ``optimizer.step()``)."""
        self._end(fabric_view(fabric, step, optimizers), unwrapped(model))

    def _begin(self, run: RunView, module: Any) -> None:
        self._logging = due(run, self.log_every_n_steps)
        if not self._logging:
            return
        if is_sharded(module):
            get_scheduler(module).memory.reset_peak()
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.device)

    def _end(self, run: RunView, module: Any) -> None:
        if not self._logging:
            return
        stats = stats_over_ranks(run, self.read(run, module))
        log_to_loggers(run, {f"{self.prefix}/{name}": value for name, value in stats.items()})

    def read(self, run: RunView, module: Any) -> dict[str, float]:
        """This rank's readings (the values before aggregation)."""
        device = run.device
        values: dict[str, float] = {}
        if device.type == "cuda":
            cuda = torch.cuda.memory_stats(device)
            values["cuda_allocated_peak"] = cuda.get("allocated_bytes.all.peak", 0) / MIB
            values["cuda_reserved_peak"] = cuda.get("reserved_bytes.all.peak", 0) / MIB
            values["cuda_alloc_retries"] = float(cuda.get("num_alloc_retries", 0))
            values["cuda_ooms"] = float(cuda.get("num_ooms", 0))
        values["rss"] = psutil.Process().memory_info().rss / MIB
        values["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB
        if is_sharded(module):
            scheduler = get_scheduler(module)
            sharded = scheduler.sharded_bytes()
            values["sharded_params"] = sharded["params"] / MIB
            values["sharded_grads"] = sharded["grads"] / MIB
            values["optimizer_state"] = _optimizer_bytes(run.optimizers) / MIB
            values["gathered_now"] = scheduler.memory.current / MIB
            values["gathered_peak"] = scheduler.memory.peak / MIB
        return values


def _optimizer_bytes(optimizers: list) -> int:
    return sum(
        value.numel() * value.element_size()
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )
