"""Every option of the engine and the strategies, validated once, without Lightning: the floor the
engine, the memory plan and both strategies share.

``ShardingOptions`` is how the engine shards and schedules a model; ``StrategyOptions`` adds what
both strategies take beyond Lightning's plumbing (checkpoint type, mesh, backend, timeouts) and is
what the memory plan checks its arguments with, so a plan refuses what training would refuse,
without building a strategy (``PrecisionRules``, in config.py, is what a precision name means). A
bad value is a ``TypeError``/``ValueError`` naming the argument, the value and what is accepted.
"""

from __future__ import annotations

import difflib
import importlib
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from fsdp_strategy.config import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, validate_device_mesh
from fsdp_strategy.wrap import ModuleNames, as_policy_fn

# keyword -> (value accepted as is, or None: any value refused; why)
FSDP_KEYWORDS: dict[str, tuple[Any, str]] = {
    "use_orig_params": (
        True,
        "the engine shards every parameter on its own and the optimizer sees them under their own names, which "
        "is FSDP's use_orig_params=True; flat parameters (False) are not offered",
    ),
    "limit_all_gathers": (
        True,
        "the engine never has more than one all-gather ahead of the running unit, which is what "
        "limit_all_gathers=True bounds; there is no unbounded mode (False)",
    ),
    "process_group": (
        None,
        "the strategy shards over the Trainer's ranks; for hybrid sharding pass device_mesh=(replicate, shard)",
    ),
    "device_id": (None, "each rank's device comes from Trainer(accelerator=..., devices=...)"),
    "ignored_states": (None, "use ignored_modules=[...] (modules whose parameters are not sharded)"),
}


def check_fsdp_keywords(kwargs: dict[str, Any], accepted: list[str], owner: str = "FSDPCustomStrategy") -> None:
    """Raise for an FSDP keyword this strategy cannot honour (saying why) or an unknown one (with
    the closest accepted name; ``accepted``: the argument names of ``owner``, the one named)."""
    everything = sorted({*accepted, *FSDP_KEYWORDS})
    for name in sorted(set(kwargs) - set(FSDP_KEYWORDS)):
        close = difflib.get_close_matches(name, everything, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"{owner} got an unexpected argument {name!r}{hint} Accepted: {', '.join(everything)}")
    for name, value in kwargs.items():
        accepted_value, why = FSDP_KEYWORDS[name]
        if accepted_value is None or value is not accepted_value:  # True only: not 1, not 1.0
            raise ValueError(f"{name}={value!r} has no meaning for fsdp_custom: {why}")


def check_parallel_sizes(
    data_parallel_size: Any, tensor_parallel_size: Any, hybrid: bool, device_mesh: Any, budget: bool
) -> tuple[int | str, int | str] | None:
    """The (data_parallel_size, tensor_parallel_size) of a 2-D run, as given (ints or "auto", with
    ``ModelParallelStrategy``'s meaning: "auto" data parallel is the number of nodes, "auto" tensor
    parallel the devices per node); None when neither is given (one data-parallel dimension). A bad
    value, or one given with a hybrid strategy, a ``device_mesh`` or ``auto_wrap_policy="auto"``
    (``budget``), raises naming it and what is accepted."""
    sizes = {"data_parallel_size": data_parallel_size, "tensor_parallel_size": tensor_parallel_size}
    if all(value is None for value in sizes.values()):
        return None
    for name, value in sizes.items():
        if value is not None and value != "auto" and (type(value) is not int or value < 1):
            raise ValueError(f"{name}={value!r} is not supported; accepted: a positive int or 'auto'")
    given = ", ".join(f"{name}={value!r}" for name, value in sizes.items() if value is not None)
    if hybrid or device_mesh is not None:
        raise ValueError(
            f"{given} with a hybrid sharding_strategy or a device_mesh is not supported: tensor parallel shards over "
            "one data-parallel dimension; accepted with it: sharding_strategy 'FULL_SHARD', 'SHARD_GRAD_OP' or "
            "'NO_SHARD' and no device_mesh"
        )
    if budget:
        raise ValueError(
            f"{given} with auto_wrap_policy='auto' is not supported: a memory budget chooses among 1-D settings only; "
            "accepted: an auto_wrap_policy you choose (a set of block classes), planned with "
            "fsdp_strategy.plan(..., tensor_parallel_size=...) or fsdp-plan --tensor-parallel-size"
        )
    return (
        "auto" if data_parallel_size is None else data_parallel_size,
        "auto" if tensor_parallel_size is None else tensor_parallel_size,
    )


def checkpointing_policy(activation_checkpointing: Any, policy: Any) -> Any:
    """Lightning's deprecated ``activation_checkpointing`` (a class or list of classes) as a policy."""
    if activation_checkpointing is not None and policy is not None:
        raise ValueError(
            "You cannot set both `activation_checkpointing` and `activation_checkpointing_policy`. Use the latter."
        )
    if activation_checkpointing is not None:
        classes = activation_checkpointing if isinstance(activation_checkpointing, list) else [activation_checkpointing]
        if not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
            raise TypeError(
                f"activation_checkpointing must be a module class or a list of them, got {activation_checkpointing!r}"
            )
        policy = set(classes)
    if not isinstance(policy, ModuleNames):  # names are checked against the model when applied
        as_policy_fn(policy, argument="activation_checkpointing_policy")
    return policy


STATE_DICT_TYPES = ("full", "sharded")


def check_checkpoint_options(state_dict_type: Any, async_save: Any) -> str:
    """``state_dict_type`` ("full" or "sharded"), checked with ``async_save`` (sharded only)."""
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={state_dict_type!r} is not supported; accepted: {STATE_DICT_TYPES}")
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save must be a bool, got {async_save!r}")
    if async_save and state_dict_type != "sharded":
        raise ValueError("async_save=True needs state_dict_type='sharded' (a full checkpoint is gathered to rank 0)")
    return state_dict_type


def check_backend(backend: Any) -> str | None:
    """None, or a process group backend torch knows ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...)."""
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"process_group_backend must be a string like 'gloo' or 'nccl', got {backend!r}")
    known = [name for name in dist.Backend.backend_list if name != "undefined"]
    names = [part.split(":")[-1] for part in backend.lower().split(",")]
    if not all(names) or any(name not in known for name in names):
        raise ValueError(f"process_group_backend={backend!r} is not a backend torch knows; accepted: {known}")
    return backend


def check_timeout(timeout: Any) -> timedelta | None:
    """None (torch's default) or a positive ``datetime.timedelta``."""
    if timeout is None:
        return None
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, e.g. timedelta(minutes=10), got {timeout!r}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r} must be positive")
    return timeout


def init_process_group_kwargs(device: torch.device, timeout: timedelta | None) -> dict[str, Any]:
    """``init_process_group`` options, as Lightning's FSDP passes them: the timeout, and on an
    accelerator its device (NCCL then binds the group to it at once)."""
    return {"timeout": timeout, "device_id": device if device.type != "cpu" else None}


class UpdateKind(str, Enum):
    """How an optimizer's update of a parameter depends on the parameter."""

    ELEMENTWISE = "elementwise"  # each element's update depends on that element alone: shards step as they are
    WHOLE_MATRIX = "whole_matrix"  # each parameter's update depends on its whole tensor: placed whole on one rank


def check_optimizer_updates(value: Any) -> dict[type, UpdateKind]:
    """``optimizer_updates``: ``{optimizer class (or its dotted path): "elementwise" | "whole_matrix"}``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"optimizer_updates must be a dict {{optimizer class: 'elementwise' | 'whole_matrix'}}, got {value!r}"
        )
    declared = {}
    for key, kind in value.items():
        cls = _import(key) if isinstance(key, str) else key
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_updates key {key!r} is not a torch.optim.Optimizer class (or a dotted path)")
        try:
            declared[cls] = UpdateKind(kind)
        except ValueError:
            raise ValueError(
                f"optimizer_updates[{cls.__name__}]={kind!r}; accepted: {[k.value for k in UpdateKind]}"
            ) from None
    return declared


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"optimizer_updates key {path!r}: cannot import it ({error})") from None


@dataclass(frozen=True)
class ShardingOptions:
    """How the engine shards and schedules a model: every option of ``shard_model`` that is not
    about where it runs (device, groups, mesh), validated. Build it with ``validate``."""

    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    auto_wrap_policy: Any = None  # as given (a set, an int, a callable or None); ``wrap_policy`` is the function
    mixed_precision: MixedPrecision | None = None
    cpu_offload: CPUOffload = CPUOffload()
    param_init_fn: Any = None
    forward_prefetch: bool = True
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    sync_module_states: bool = False
    ignored_modules: tuple[torch.nn.Module, ...] | None = None
    collective_timeout: float | None = None  # seconds; None: the process group's own timeout
    check_collective_order: bool = True
    optimizer_updates: dict | None = None  # optimizer class -> UpdateKind ([Note: trust by allow-list])

    @property
    def wrap_policy(self) -> Any:
        """``auto_wrap_policy`` as a function ``(module, recurse, nonwrapped_numel) -> bool``, or None."""
        return as_policy_fn(self.auto_wrap_policy)

    @classmethod
    def validate(
        cls,
        sharding_strategy: Any = "FULL_SHARD",
        auto_wrap_policy: Any = None,
        mixed_precision: Any = None,
        cpu_offload: Any = None,
        param_init_fn: Any = None,
        forward_prefetch: Any = True,
        backward_prefetch: Any = "BACKWARD_PRE",
        sync_module_states: Any = False,
        ignored_modules: Any = None,
        collective_timeout: Any = None,
        check_collective_order: Any = True,
        optimizer_updates: Any = None,
    ) -> ShardingOptions:
        """Check and convert every option; a bad one is a ``TypeError``/``ValueError`` naming the
        argument, the value and what is accepted."""
        as_policy_fn(auto_wrap_policy)
        if param_init_fn is not None and not callable(param_init_fn):
            raise TypeError(f"param_init_fn must be a callable (module) -> None, got {param_init_fn!r}")
        for name, value in (
            ("forward_prefetch", forward_prefetch),
            ("sync_module_states", sync_module_states),
            ("check_collective_order", check_collective_order),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        return cls(
            ShardingStrategy.from_any(sharding_strategy),
            auto_wrap_policy,
            MixedPrecision.from_any(mixed_precision),
            CPUOffload.from_any(cpu_offload),
            param_init_fn,
            forward_prefetch,
            BackwardPrefetch.from_any(backward_prefetch),
            sync_module_states,
            check_ignored_modules(ignored_modules),
            check_collective_timeout(collective_timeout),
            check_collective_order,
            check_optimizer_updates(optimizer_updates),
        )


def check_ignored_modules(value: Any) -> tuple[torch.nn.Module, ...] | None:
    """None, or a list of modules (of the model: checked when it is sharded)."""
    if value is None:
        return None
    listed = not isinstance(value, torch.nn.Module) and isinstance(value, Iterable)
    modules = tuple(value) if listed else ()  # once: a generator is read here only
    if not listed or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise TypeError(f"ignored_modules must be a list of modules of the model, got {value!r}")
    return modules


def check_collective_timeout(value: Any) -> float | None:
    """``collective_timeout`` as seconds: a positive number (``math.inf``: no limit), a positive
    timedelta, or None (the process group's own timeout, decided when the watchdog starts)."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"collective_timeout must be seconds (a number), a timedelta or None, got {value!r}")
    try:
        seconds = float(seconds)
    except OverflowError:
        seconds = math.inf
    if not seconds > 0:
        raise ValueError(
            f"collective_timeout={value!r} must be positive (None: the process group's timeout; math.inf: no limit)"
        )
    return seconds


OPTION_NAMES = tuple(field.name for field in fields(ShardingOptions))


def options_from(arguments: Mapping[str, Any]) -> ShardingOptions:
    """``ShardingOptions.validate`` of the arguments named as its fields (``shard_model``'s or a
    strategy constructor's ``locals()``)."""
    return ShardingOptions.validate(**{name: arguments[name] for name in OPTION_NAMES})


def check_auto_choices(arguments: Mapping[str, Any]) -> None:
    """``auto_wrap_policy="auto"`` chooses activation checkpointing, CPU offload and FULL_SHARD or
    SHARD_GRAD_OP itself and plans a copy of the model: refuse arguments that set them (the
    strategies and the memory plan alike)."""
    given = [name for name in ("activation_checkpointing", "activation_checkpointing_policy") if arguments.get(name)]
    if given:
        raise ValueError(f"auto_wrap_policy='auto' chooses activation checkpointing itself; drop {given}")
    sharding = arguments.get("sharding_strategy", "FULL_SHARD")
    chosen = {"cpu_offload": arguments.get("cpu_offload"), "sharding_strategy": sharding}
    grad_op = ShardingStrategy.from_any(sharding) is ShardingStrategy.SHARD_GRAD_OP
    if chosen["cpu_offload"] not in (None, False) or grad_op:  # FULL_SHARD is the default: not "given"
        raise ValueError(
            f"auto_wrap_policy='auto' chooses cpu_offload and SHARD_GRAD_OP/FULL_SHARD itself; drop {chosen} "
            "(a HYBRID_SHARD or NO_SHARD sharding_strategy is kept)"
        )
    if arguments.get("ignored_modules") is not None:
        raise ValueError("auto_wrap_policy='auto' plans a copy of the model, which ignored_modules cannot name")


# the Trainer strategy's arguments that Lightning fills in (the plan accepts and ignores them)
LIGHTNING_PLUMBING = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")

# The strategy arguments beyond ShardingOptions', with the Trainer strategy's defaults (timeout: the
# process group's own): what an argument a plan is not given stands for (tests/test_config.py).
STRATEGY_DEFAULTS: dict[str, Any] = {
    "activation_checkpointing": None,
    "activation_checkpointing_policy": None,
    "state_dict_type": "full",
    "device_mesh": None,
    "async_save": False,
    "process_group_backend": None,
    "timeout": None,
}


@dataclass(frozen=True)
class StrategyOptions:
    """Every argument the strategies take beyond Lightning's plumbing (accelerator, devices,
    cluster environment, precision plugin, checkpoint IO), validated: what both strategies keep and
    what the memory plan plans with. Build it with ``from_arguments``; costs nothing but the checks."""

    sharding: ShardingOptions
    activation_checkpointing_policy: Any
    state_dict_type: str
    device_mesh: Any  # None, (replicate, shard) sizes, or a 2-D DeviceMesh
    process_group_backend: str | None
    timeout: timedelta | None

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], fsdp_keywords: Mapping[str, Any] | None = None) -> Any:
        """Check ``arguments`` (a strategy constructor's ``locals()``, or any subset of the
        arguments: the rest take the strategies' defaults) and ``fsdp_keywords`` (the FSDP keywords
        passed through ``**kwargs``); an unknown name is a ``TypeError`` with the closest accepted one."""
        defaults = {field.name: field.default for field in fields(ShardingOptions)} | STRATEGY_DEFAULTS
        check_fsdp_keywords(dict(fsdp_keywords or {}), list(defaults))
        given = {**defaults, **arguments}
        sharding = options_from(given)
        return cls(
            sharding,
            checkpointing_policy(given["activation_checkpointing"], given["activation_checkpointing_policy"]),
            check_checkpoint_options(given["state_dict_type"], given["async_save"]),
            validate_device_mesh(given["device_mesh"], sharding.sharding_strategy),
            check_backend(given["process_group_backend"]),
            check_timeout(given["timeout"]),
        )

    @staticmethod
    def split(arguments: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``arguments`` as (strategy arguments, FSDP keywords): what ``from_arguments`` takes.
        Lightning's plumbing (``accelerator``, ...) is neither: it means nothing to the checks."""
        arguments = {key: value for key, value in arguments.items() if key not in LIGHTNING_PLUMBING}
        known = {field.name for field in fields(ShardingOptions)} | set(STRATEGY_DEFAULTS)
        return {k: v for k, v in arguments.items() if k in known}, {
            k: v for k, v in arguments.items() if k not in known
        }
