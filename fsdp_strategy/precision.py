"""The strategy's precision plugin: Lightning's FSDP precision, made device-agnostic.

Lightning's ``FSDPPrecision`` hard-codes CUDA autocast, builds a CUDA-only grad scaler and
refuses clipping by norm. This plugin autocasts on the strategy's device type (CPU too),
builds a ``ShardedGradScaler`` for that device (its inf check is all-reduced over all ranks),
and clips by the global norm of the sharded gradients (one all-reduce).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, get_args

import torch
from lightning.fabric.plugins.precision.fsdp import _PRECISION_INPUT
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from torch.optim import Optimizer

from fsdp_strategy.config import MixedPrecision

_LOW = {"bf16": torch.bfloat16, "16": torch.float16}


class FSDPCustomPrecision(FSDPPrecision):
    """Precision for ``FSDPCustomStrategy``: "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true".

    "*-mixed" gathers parameters in the low dtype, reduces gradients in fp32, keeps fp32
    master shards and runs the step under ``torch.autocast`` on the device type in use.
    "*-true" converts the whole module (shards, optimizer state) to the low dtype.
    """

    def __init__(self, precision: _PRECISION_INPUT, scaler: Any = None) -> None:
        if precision not in get_args(_PRECISION_INPUT):
            raise ValueError(
                f"precision={precision!r} is not supported by the fsdp_custom strategy; "
                f"accepted: {list(get_args(_PRECISION_INPUT))}"
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} does not use a grad scaler, got {scaler}")
        self.precision = precision
        self.scaler = scaler
        self._user_scaler = scaler is not None
        self._low = _LOW.get(precision.split("-")[0], torch.float32)  # the dtype the name asks for
        self._desired_input_dtype = self._low if precision.endswith("-true") else torch.float32
        self.device_type = "cpu"
        self.clip_fn: Any = None

    @classmethod
    def from_plugin(cls, plugin: Precision | None) -> FSDPCustomPrecision:
        """Convert the plugin Lightning built from ``Trainer(precision=...)`` into this one."""
        if plugin is None or isinstance(plugin, cls):
            return plugin or cls("32-true")
        precision = getattr(plugin, "precision", "32-true")
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and type(scaler).__name__ != "ShardedGradScaler":
            scaler = None  # Lightning's default (unsharded) scaler: replaced by a sharded one at setup
        return cls(precision, scaler=scaler)

    def attach(self, device_type: str, clip_fn: Any) -> None:
        """Bind to the device type and the engine's sharded clipping; build the grad scaler."""
        self.device_type = device_type
        self.clip_fn = clip_fn
        if self.precision == "16-mixed" and not self._user_scaler:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=device_type)

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:  # type: ignore[override]
        """The engine's MixedPrecision for "*-mixed": params and buffers low, gradients reduced in fp32."""
        if not self.precision.endswith("-mixed"):
            return None
        return MixedPrecision(param_dtype=self._low, reduce_dtype=torch.float32, buffer_dtype=self._low)

    def forward_context(self) -> AbstractContextManager:
        if self.precision.endswith("-mixed"):
            return torch.autocast(self.device_type, dtype=self._low)
        return super().forward_context()

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip ``optimizer``'s parameters by their global norm over every rank's shards (one all-reduce)."""
        if self.clip_fn is None:
            raise RuntimeError("gradient clipping by norm needs the model to be set up by FSDPCustomStrategy")
        self.clip_fn(clip_val, parameters=[p for group in optimizer.param_groups for p in group["params"]])
