"""ThroughputMonitor: samples/s, tokens/s, step time, FLOPs/s and MFU, with Lightning's ``Throughput``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import Callback

from fsdp_strategy.callbacks.ranks import (
    OptimizerStepWindow,
    RunView,
    check_every,
    due,
    fabric_view,
    log_to_loggers,
    trainer_view,
    unwrapped,
)


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    tensor = _first_tensor(batch)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() > 0 else 1


def token_count(batch: Any) -> int | None:
    """Tokens in a batch when it says so: a 2-D integer tensor (batch, sequence) first; else None."""
    tensor = _first_tensor(batch)
    if tensor is not None and tensor.dim() == 2 and not tensor.is_floating_point():
        return int(tensor.numel())
    return None


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class ThroughputMonitor(Callback):
    """Logs ``{prefix}/samples_per_sec``, ``items_per_sec`` (tokens), ``device/...``, ``step_time_s``,
    and, when the LightningModule has a ``flops_per_batch`` attribute (FLOPs of one rank's batch,
    forward and backward, e.g. from Lightning's ``measure_flops``), ``flops_per_sec`` and
    ``device/mfu`` (MFU needs the device's peak: known for CUDA GPUs, or pass ``available_flops``).

    Rates are averaged over the last ``window_size`` steps and logged every ``log_every_n_steps``
    (default: the Trainer's). In a Fabric loop, call ``on_fabric_step_start`` /
    ``on_fabric_step_end`` (with one micro-batch and their number) around each optimizer step
    through ``fabric.call`` (as ``MemoryMonitor``).
    Costs: a clock read per step (plus a CUDA synchronize, so that step times are true).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        window_size: int = 20,
        batch_size_fn: Callable[[Any], int] = batch_size,
        length_fn: Callable[[Any], int | None] = token_count,
        available_flops: float | None = None,
        prefix: str = "throughput",
    ) -> None:
        if window_size < 2:
            raise ValueError(f"window_size={window_size} must be >= 2")
        self.log_every_n_steps = check_every(log_every_n_steps)
        self.window_size = window_size
        self.batch_size_fn = batch_size_fn
        self.length_fn = length_fn
        self.available_flops = available_flops
        self.prefix = prefix
        self._throughput: Throughput | None = None
        self._counts = {"batches": 0, "samples": 0, "lengths": 0}
        self._t0 = self._step_start = 0.0
        self._window = OptimizerStepWindow()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer_view(trainer), pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._window.begins(trainer):
            self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self._count(trainer_view(trainer), pl_module, batch, 1, self._window.ends(trainer))

    def on_fabric_step_start(self, fabric: Any, model: Any, step: int, **_: Any) -> None:
        """A Fabric loop's optimizer step ``step`` (0 for the first) begins (the first call starts the clock)."""
        if self._throughput is None:
            self._start(fabric_view(fabric, step), unwrapped(model))
        self._step_start = time.perf_counter()

    def on_fabric_step_end(
        self, fabric: Any, model: Any, step: int, batch: Any = None, micro_batches: int = 1, **_: Any
    ) -> None:
        """A Fabric loop's optimizer step ended: ``micro_batches`` batches like ``batch`` were trained on."""
        self._count(fabric_view(fabric, step), unwrapped(model), batch, micro_batches, True)

    def _start(self, run: RunView, module: Any) -> None:
        device = run.device
        dtype = _compute_dtype(run.precision)
        peak = self.available_flops or get_available_flops(device, dtype) if device.type != "cpu" else None
        self._throughput = Throughput(
            available_flops=self.available_flops or peak, world_size=run.world_size, window_size=self.window_size
        )
        self._counts = dict.fromkeys(self._counts, 0)
        self._t0 = time.perf_counter()

    def _count(self, run: RunView, module: Any, batch: Any, micro_batches: int, step_ended: bool) -> None:
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        now = time.perf_counter()
        counts = self._counts
        counts["batches"] += micro_batches
        counts["samples"] += self.batch_size_fn(batch) * micro_batches
        tokens = self.length_fn(batch)
        counts["lengths"] += (tokens or 0) * micro_batches
        flops = getattr(module, "flops_per_batch", None)
        assert self._throughput is not None
        self._throughput.update(
            time=now - self._t0,
            batches=counts["batches"],
            samples=counts["samples"],
            lengths=counts["lengths"] if tokens is not None else None,
            flops=int(flops) * micro_batches if flops else None,  # on one rank; Throughput multiplies by the ranks
        )
        if step_ended and due(run, self.log_every_n_steps):
            metrics = {f"{self.prefix}/{k}": float(v) for k, v in self._throughput.compute().items()}
            metrics[f"{self.prefix}/step_time_s"] = now - self._step_start
            log_to_loggers(run, metrics)


def _compute_dtype(plugin: Any) -> torch.dtype:
    config = getattr(plugin, "mixed_precision_config", None)
    if config is not None and getattr(config, "param_dtype", None) is not None:
        return config.param_dtype
    return getattr(plugin, "_desired_input_dtype", torch.float32)
