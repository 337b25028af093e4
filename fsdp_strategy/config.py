"""User-facing configuration: sharding strategy, mixed precision and CPU offload, and what a
precision name ("bf16-mixed", ...) means for the model, its inputs and the engine (``PrecisionRules``).

Each type is a frozen, validated value. ``from_any`` converts what users pass (our type, a
string, a dict or omegaconf ``DictConfig``, or torch's own FSDP types) and raises a
``ValueError``/``TypeError`` that names the argument, the value and what is accepted.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "16": torch.float16,
}


def parse_dtype(value: Any, argument: str) -> torch.dtype | None:
    """Turn ``None``, a floating ``torch.dtype`` or a name like ``"bf16"`` into a dtype."""
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        dtype = _DTYPE_NAMES.get(value.lower().removeprefix("torch."))
        if dtype is None:
            raise ValueError(
                f"{argument}={value!r} is not a known dtype; accepted: {sorted(set(_DTYPE_NAMES))} "
                "or a floating torch.dtype"
            )
    else:
        raise TypeError(f"{argument} must be a torch.dtype, a dtype name or None, got {type(value).__name__}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"{argument}={dtype} is not a floating dtype; accepted: float32, bfloat16, float16")
    return dtype


class ShardingStrategy(str, Enum):
    """What is sharded across the data-parallel ranks."""

    FULL_SHARD = "FULL_SHARD"  # params, grads and optimizer state sharded; params freed after forward
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # as FULL_SHARD, but params stay gathered from forward to backward
    NO_SHARD = "NO_SHARD"  # everything replicated; grads all-reduced, as DDP
    HYBRID_SHARD = "HYBRID_SHARD"  # FULL_SHARD inside a shard group, replicated across groups
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"  # SHARD_GRAD_OP inside a shard group, replicated across groups

    @classmethod
    def from_any(cls, value: Any, argument: str = "sharding_strategy") -> ShardingStrategy:
        """Accept our enum, its name in any case, or torch's ``ShardingStrategy`` member."""
        if isinstance(value, cls):
            return value
        name = value.name if isinstance(value, Enum) else value
        if not isinstance(name, str):
            raise TypeError(
                f"{argument} must be a string or a ShardingStrategy, got {type(value).__name__} ({value!r})"
            )
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"{argument}={value!r} is not supported{_did_you_mean(name, cls)}") from None

    @property
    def reshard_after_forward(self) -> bool:
        """Whether a non-root unit frees its gathered parameters right after its forward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def hybrid(self) -> bool:
        """Whether shards are replicated across groups of a (replicate, shard) mesh."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class BackwardPrefetch(str, Enum):
    """When backward issues the next unit's all-gather (FSDP1's ``backward_prefetch``); None: never ahead."""

    BACKWARD_PRE = "BACKWARD_PRE"  # when the current unit's backward starts: most overlap, one unit more memory
    BACKWARD_POST = "BACKWARD_POST"  # once the current unit's gradients are computed: less overlap and memory

    @classmethod
    def from_any(cls, value: Any, argument: str = "backward_prefetch") -> BackwardPrefetch | None:
        """Accept None, our enum, its name in any case, or torch's ``BackwardPrefetch`` member."""
        if value is None or isinstance(value, cls):
            return value
        name = value.name if isinstance(value, Enum) else value
        if not isinstance(name, str):
            raise TypeError(f"{argument} must be a string, a BackwardPrefetch or None, got {type(value).__name__}")
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"{argument}={value!r} is not supported{_did_you_mean(name, cls)} or None") from None


def _did_you_mean(name: str, cls: type[Enum]) -> str:
    """What follows "is not supported": the closest accepted value, then every one (private members
    unlisted)."""
    accepted = [member.value for member in cls if not member.name.startswith("_")]
    close = difflib.get_close_matches(name.upper(), accepted, n=1)
    return (f" (did you mean {close[0]!r}?)" if close else "") + f"; accepted: {accepted}"


def _mapping_of(value: Any, argument: str, fields: tuple[str, ...]) -> Mapping[str, Any]:
    """Read a dict, an omegaconf config or an object with matching attributes as a mapping."""
    if isinstance(value, Mapping) or type(value).__name__ == "DictConfig":
        mapping = dict(value)
        unknown = sorted(set(mapping) - set(fields))
        if unknown:
            raise ValueError(f"{argument} has unknown keys {unknown}; accepted keys: {list(fields)}")
        return mapping
    return {name: getattr(value, name) for name in fields if hasattr(value, name)}


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes used while a unit is gathered; the sharded master weights keep their own dtype.

    Costs: a cast of the local shard before each all-gather; low ``param_dtype`` halves the
    all-gather bytes and the memory of gathered parameters.
    """

    param_dtype: torch.dtype | None = None  # dtype of gathered parameters (compute + all-gather); None: keep
    reduce_dtype: torch.dtype | None = None  # dtype of the gradient reduction; None: the shard's dtype (fp32)
    buffer_dtype: torch.dtype | None = None  # dtype buffers are cast to at setup; None: keep

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            object.__setattr__(self, name, parse_dtype(getattr(self, name), f"mixed_precision.{name}"))

    @classmethod
    def from_any(cls, value: Any, argument: str = "mixed_precision") -> MixedPrecision | None:
        """Accept None, ours, a dict/DictConfig, torch's FSDP1 ``MixedPrecision`` or FSDP2 policy."""
        if value is None or isinstance(value, cls):
            return value
        known = ("MixedPrecision", "MixedPrecisionPolicy")
        if not isinstance(value, Mapping) and type(value).__name__ not in (*known, "DictConfig"):
            raise TypeError(
                f"{argument} must be a MixedPrecision, torch's MixedPrecision, a dict or None, "
                f"got {type(value).__name__}"
            )
        return cls(**_mapping_of(value, argument, ("param_dtype", "reduce_dtype", "buffer_dtype")))


@dataclass(frozen=True)
class CPUOffload:
    """Keep sharded parameters, gradients and optimizer state in CPU memory.

    Costs: a host-to-device copy of each shard before its all-gather and a device-to-host copy
    of each reduced gradient shard; the optimizer step runs on the CPU.
    """

    offload_params: bool = False  # True: shards (and so gradients and optimizer state) live on the CPU

    def __post_init__(self) -> None:
        if not isinstance(self.offload_params, bool):
            raise TypeError(f"cpu_offload.offload_params must be a bool, got {self.offload_params!r}")

    @classmethod
    def from_any(cls, value: Any, argument: str = "cpu_offload") -> CPUOffload:
        """Accept None/bool, ours, a dict/DictConfig, torch's ``CPUOffload`` or ``CPUOffloadPolicy``."""
        if isinstance(value, cls):
            return value
        if value is None or isinstance(value, bool):
            return cls(offload_params=bool(value))
        name = type(value).__name__
        if name == "CPUOffloadPolicy":
            return cls(offload_params=True)
        if name == "OffloadPolicy":
            return cls(offload_params=False)
        if isinstance(value, Mapping) or name in ("CPUOffload", "DictConfig"):
            return cls(**_mapping_of(value, argument, ("offload_params",)))
        raise TypeError(f"{argument} must be a bool, a CPUOffload, a dict or None, got {name} ({value!r})")


def validate_device_mesh(device_mesh: Any, sharding_strategy: ShardingStrategy) -> Any:
    """Check ``device_mesh`` against the strategy: None, a (replicate, shard) pair or a 2-D DeviceMesh.

    None with a hybrid strategy is left for the caller to fill (the strategy: one shard group per
    node, as FSDP1 and Lightning do; ``shard_model`` needs a mesh)."""
    if device_mesh is None:
        return None
    if not sharding_strategy.hybrid:
        raise ValueError(
            f"device_mesh={device_mesh!r} is only used with sharding_strategy='HYBRID_SHARD' or "
            f"'_HYBRID_SHARD_ZERO2', got {sharding_strategy.value!r}"
        )
    if isinstance(device_mesh, (tuple, list)):
        if len(device_mesh) != 2 or not all(isinstance(n, int) and n >= 1 for n in device_mesh):
            raise ValueError(f"device_mesh={device_mesh!r} must be (replicate, shard): two positive ints")
        return tuple(device_mesh)
    if type(device_mesh).__name__ != "DeviceMesh":
        raise TypeError(f"device_mesh must be a (replicate, shard) tuple or a DeviceMesh, got {type(device_mesh)}")
    return device_mesh


PRECISIONS = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")  # Lightning's FSDP precisions
_LOW = {"bf16": torch.bfloat16, "16": torch.float16}


class PrecisionRules:
    """What a precision name means for the model, its inputs and the engine, on any device type:
    "*-mixed" gathers parameters and keeps buffers in the low dtype, reduces gradients in fp32,
    keeps fp32 master shards and runs forward under ``torch.autocast``; "*-true" converts the whole
    module (shards, optimizer state) and the inputs to the low dtype. The strategies' precision
    plugins and the memory plan both follow these rules."""

    def __init__(self, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"precision={precision!r} is not supported by the fsdp_custom strategy; accepted: {list(PRECISIONS)}"
            )
        self.precision = precision
        self.low = _LOW.get(precision.split("-")[0], torch.float32)  # the dtype the name asks for
        self.mixed = precision.endswith("-mixed")
        self.input_dtype = torch.float32 if self.mixed else self.low
        self.converts = precision != "32-true"  # "32-true" converts nothing, as DDP: not the module, not a batch

    def input_dtype_of(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a batch's floating tensor of ``dtype`` is given to the model in (others keep theirs)."""
        return self.input_dtype if self.converts and dtype.is_floating_point else dtype

    @property
    def engine_mixed_precision(self) -> MixedPrecision | None:
        """What the engine is given: for "*-mixed", params and buffers low, gradients reduced in fp32;
        None otherwise (the module itself is in the precision's dtype: nothing to cast)."""
        if not self.mixed:
            return None
        return MixedPrecision(param_dtype=self.low, reduce_dtype=torch.float32, buffer_dtype=self.low)

    @property
    def mixed_precision_config(self) -> MixedPrecision:
        """The dtypes training runs in, one object for every precision (as Lightning's
        ``FSDPPrecision.mixed_precision_config`` is; "*-true": every dtype that of the module)."""
        engine = self.engine_mixed_precision
        return engine if engine is not None else MixedPrecision(self.low, self.low, self.low)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """ "bf16-true" / "16-true": the module's floating parameters and buffers in the low dtype, its
        complex ones in complex64 (no complex bfloat16 exists, and torch's complex32 cannot train: its
        backward lacks kernels as basic as ``sum``), integer and bool ones untouched. "32-true" and
        "*-mixed": unchanged, as under DDP. (``module.to(dtype)`` would keep only the real part of a
        complex tensor: a rotary table ``freqs_cis`` would become its cosines.)"""
        if self.mixed or not self.converts:
            return module
        return module._apply(functools.partial(convert_tensor, dtype=self.low))

    def forward_context(self, device_type: str) -> AbstractContextManager:
        """``torch.autocast`` to the low dtype ("*-mixed"), else tensors created in the module's dtype."""
        if self.mixed:
            return torch.autocast(device_type, dtype=self.low)
        return _default_dtype(self.input_dtype)


def convert_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the low floating ``dtype`` if it is floating; a complex one in complex64 (the
    narrowest complex dtype torch trains in); any other unchanged."""
    if tensor.is_floating_point():
        return tensor.to(dtype)
    if tensor.is_complex():
        return tensor.to(torch.complex64)
    return tensor


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
