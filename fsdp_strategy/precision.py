"""The strategies' precision plugins: Lightning's FSDP precision, made device-agnostic.

Lightning's ``FSDPPrecision`` (the Trainer's and Fabric's) hard-codes CUDA autocast, builds a
CUDA-only grad scaler and refuses clipping by norm. These plugins autocast on the strategy's
device type (CPU too), build a ``ShardedGradScaler`` for that device (its inf check is
all-reduced over all ranks), and the Trainer's clips by the global norm of the sharded gradients
(one all-reduce). ``DeviceAgnosticPrecision`` is what both share.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

import torch
from lightning.fabric.plugins import precision as fabric_precision
from lightning.fabric.plugins.precision.fsdp import _PRECISION_INPUT
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer

from fsdp_strategy.config import MixedPrecision, PrecisionRules


class DeviceAgnosticPrecision:
    """ "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true" on any device type, by
    ``PrecisionRules`` (config.py: "*-mixed" gathers parameters in the low dtype, reduces gradients
    in fp32, keeps fp32 master shards and runs forward under ``torch.autocast`` on the device type
    in use; "*-true" converts the whole module and its inputs), with the grad scaler of "16-mixed".
    """

    def __init__(self, precision: _PRECISION_INPUT, scaler: Any = None) -> None:
        self.rules = PrecisionRules(precision)
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} does not use a grad scaler, got {scaler}")
        self.precision = precision
        # a given scaler is rebuilt in attach() as a ShardedGradScaler for the strategy's device
        self._scaler_settings, self._scaler_device = _scaler_settings(scaler) if scaler is not None else ({}, None)
        self.scaler = None
        self._desired_input_dtype = self.rules.input_dtype  # Lightning's convert_input reads it
        self.device_type = "cpu"
        self.clip_fn: Any = None
        self.before_update: Any = None

    def attach(self, device_type: str, clip_fn: Any = None, before_update: Any = None) -> None:
        """Bind to the device type (and the engine's sharded clipping and the wait the update
        needs, ``before_update``); build the grad scaler."""
        self.device_type = device_type
        self.clip_fn = clip_fn
        self.before_update = before_update
        if self.precision == "16-mixed" and self.scaler is None:
            settings = dict(self._scaler_settings)
            if not settings.get("enabled", True) and self._scaler_device not in (None, device_type):
                settings = {}  # disabled only because its device is absent here (FSDPPrecision's CUDA default on a CPU)
            self.scaler = ComplexAwareGradScaler(device=device_type, **settings)

    @property
    def mixed_precision_config(self) -> MixedPrecision:
        """The dtypes this precision trains in, an object for every precision as Lightning's
        ``FSDPPrecision.mixed_precision_config`` (clients such as Lightning's ``ThroughputMonitor``
        read it); "*-mixed" reduces gradients in fp32 (Lightning's reduces in the low dtype)."""
        return self.rules.mixed_precision_config

    @property
    def engine_mixed_precision(self) -> MixedPrecision | None:
        """What the engine is given: for "*-mixed", params and buffers low, gradients reduced in fp32;
        None otherwise (the module itself is in the precision's dtype: nothing to cast)."""
        return self.rules.engine_mixed_precision

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.rules.convert_module(module)

    def convert_input(self, data: Any) -> Any:
        """Floating tensors of a batch in the precision's input dtype (complex, integer and bool ones as
        they are); "32-true" converts nothing, as under DDP."""
        return super().convert_input(data) if self.rules.converts else data

    def convert_output(self, data: Any) -> Any:
        """Fabric's outputs, as Lightning's FSDP precision returns them; "32-true": as they are, as under DDP."""
        return super().convert_output(data) if self.rules.converts else data

    def forward_context(self) -> AbstractContextManager:
        """What Lightning's FSDP precision returns, on this device type: ``torch.autocast`` ("*-mixed"),
        Lightning's ``_DtypeContextManager`` ("*-true": tensors created in the precision's dtype)."""
        if self.rules.mixed:
            return self.rules.forward_context(self.device_type)
        return _DtypeContextManager(self.rules.input_dtype)


class ComplexAwareGradScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` (its inf check all-reduced over every rank's shards) that also
    unscales complex gradients, as their real and imaginary parts: torch's unscale kernel has none
    for complex dtypes. Costs: nothing more where no gradient is complex."""

    def _unscale_grads_(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        groups = optimizer.param_groups
        if not any(p.grad is not None and p.grad.is_complex() for group in groups for p in group["params"]):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        real_views = [  # the same memory: unscaling a view unscales the gradient
            SimpleNamespace(grad=torch.view_as_real(p.grad) if p.grad.is_complex() else p.grad)
            for group in groups
            for p in group["params"]
            if p.grad is not None
        ]
        viewed = SimpleNamespace(param_groups=[{"params": real_views}])
        return super()._unscale_grads_(viewed, inv_scale, found_inf, allow_fp16)


def _convert(cls: type, plugin: Any, convertible: tuple[type, ...], how: str) -> Any:
    """``plugin`` as a ``cls`` by its precision name (a GradScaler's settings kept), or a TypeError."""
    if plugin is None or isinstance(plugin, cls):
        return plugin or cls("32-true")
    if type(plugin) not in convertible:
        raise TypeError(
            f"The fsdp_custom strategy cannot honour the precision plugin {type(plugin).__name__}: it converts "
            "Lightning's Precision, MixedPrecision, HalfPrecision and FSDPPrecision by their precision name and "
            f"would drop this plugin's own behaviour. Use {how}"
        )
    return cls(getattr(plugin, "precision", "32-true"), scaler=getattr(plugin, "scaler", None))


class FSDPCustomPrecision(DeviceAgnosticPrecision, FSDPPrecision):
    """The Trainer's precision for ``FSDPCustomStrategy`` (``DeviceAgnosticPrecision``), clipping
    by the global norm of the shards."""

    @classmethod
    def from_plugin(cls, plugin: Precision | None) -> FSDPCustomPrecision:
        """Convert a plugin Lightning built from ``Trainer(precision=...)`` (or one of its own
        classes a user passed) into this one; refuse what would lose its meaning.

        Lightning's ``Precision``, ``MixedPrecision``, ``HalfPrecision``, ``DoublePrecision`` and
        ``FSDPPrecision`` convert by their ``precision`` name; a ``GradScaler`` becomes a
        ``ShardedGradScaler`` with its settings (its inf check then covers every rank's shards).
        Any other plugin (a subclass, bitsandbytes, Transformer Engine, ...) is a ``TypeError``:
        its own hooks would be dropped.
        """
        return _convert(cls, plugin, _convertible(), "Trainer(precision=...) or plugins=[FSDPCustomPrecision(...)]")

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        """After the closure's hooks (``on_before_optimizer_step`` may run the model, copying
        offloaded shards to the device) and clipping, wait before the update writes the shards
        ([Note: host and device] 1 in engine/device.py)."""
        super()._after_closure(model, optimizer)
        if self.before_update is not None:
            self.before_update()

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip ``optimizer``'s parameters by their global norm over every rank's shards (one all-reduce)."""
        if self.clip_fn is None:
            raise RuntimeError("gradient clipping by norm needs the model to be set up by FSDPCustomStrategy")
        self.clip_fn(clip_val, parameters=[p for group in optimizer.param_groups for p in group["params"]])


class FSDPCustomFabricPrecision(DeviceAgnosticPrecision, fabric_precision.FSDPPrecision):
    """Fabric's precision for ``FSDPCustomFabricStrategy`` (``DeviceAgnosticPrecision``)."""

    @classmethod
    def from_plugin(cls, plugin: fabric_precision.Precision | None) -> FSDPCustomFabricPrecision:
        """Convert the plugin Fabric built from ``Fabric(precision=...)`` (or one of its classes a user
        passed) into this one, as ``FSDPCustomPrecision.from_plugin`` does for the Trainer."""
        fabric_classes = ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision", "FSDPPrecision")
        convertible = tuple(getattr(fabric_precision, name) for name in fabric_classes)
        return _convert(cls, plugin, convertible, "Fabric(precision=...)")


def _convertible() -> tuple[type, ...]:
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    return (Precision, MixedPrecision, HalfPrecision, DoublePrecision, FSDPPrecision)


def _scaler_settings(scaler: Any) -> tuple[dict[str, Any], str | None]:
    """A torch ``GradScaler``'s settings and device, for the ``ShardedGradScaler`` that replaces it."""
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch GradScaler or ShardedGradScaler, got {type(scaler).__name__}")
    device = getattr(scaler, "_device", None)
    if not scaler.is_enabled():  # a disabled scaler keeps no other settings
        return {"enabled": False}, device
    return {
        "init_scale": scaler.get_scale(),
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
        "enabled": True,
    }, device
