"""The strategy's arguments that come from Lightning's ``FSDPStrategy`` and torch's FSDP: checked in
the constructor, each accepted with its meaning there or refused with why it has none here.

Lightning's ``FSDPStrategy(**kwargs)`` passes any other keyword to torch's FSDP1. A user
switching strategies brings those along; ``FSDP_KEYWORDS`` says what each does here.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fsdp_strategy.config import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, validate_device_mesh
from fsdp_strategy.engine.optimizer_kinds import check_optimizer_updates
from fsdp_strategy.wrap import ModuleNames, already_checkpointed, apply_activation_checkpointing, as_policy_fn

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


def check_fsdp_keywords(kwargs: dict[str, Any], accepted: list[str]) -> None:
    """Raise for an FSDP keyword this strategy cannot honour (saying why) or an unknown one (with
    the closest accepted name; ``accepted``: the strategy's own argument names)."""
    everything = sorted({*accepted, *FSDP_KEYWORDS})
    for name in sorted(set(kwargs) - set(FSDP_KEYWORDS)):
        close = difflib.get_close_matches(name, everything, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(
            f"FSDPCustomStrategy got an unexpected argument {name!r}{hint} Accepted: {', '.join(everything)}"
        )
    for name, value in kwargs.items():
        accepted_value, why = FSDP_KEYWORDS[name]
        if accepted_value is None or value is not accepted_value:  # True only: not 1, not 1.0
            raise ValueError(f"{name}={value!r} has no meaning for fsdp_custom: {why}")


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


def apply_recomputation(model: torch.nn.Module, policy: Any) -> None:
    """``activation_checkpointing_policy`` applied to ``model`` as Lightning's FSDP applies it: a
    model that already holds checkpointed layers gets Lightning's warning and is left as it is
    (they would be recomputed twice)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    if already_checkpointed(model):
        rank_zero_warn(
            "FSDP checkpointing is configured, but the model already contains checkpointed layers."
            " Checkpointing will be ignored."
        )
        return
    apply_activation_checkpointing(model, policy)


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


def refuse_whole_model_averaging(callbacks: list) -> None:
    """Raise for ``StochasticWeightAveraging`` and for more than one ``WeightAveraging``.

    SWA deep-copies the whole unsharded module before the strategy shards it and, at its end,
    runs an extra epoch of forward passes through its own copy to recompute BatchNorm statistics:
    both need every parameter on every rank. ``WeightAveraging`` (EMA, or SWA's average with
    ``avg_fn=get_swa_avg_fn()``) averages each rank's shards instead ([Note: sharded weight
    averaging] in averaging.py); two of them would overwrite each other's checkpoint entries."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    if any(isinstance(c, StochasticWeightAveraging) for c in callbacks):
        raise MisconfigurationException(
            "StochasticWeightAveraging cannot work with the fsdp_custom strategy: it copies the whole unsharded model "
            "and recomputes BatchNorm statistics with forward passes through that copy, while each rank holds only "
            "its shard of the parameters. Use lightning.pytorch.callbacks.WeightAveraging(avg_fn=get_swa_avg_fn()) "
            "from torch.optim.swa_utils: it averages each rank's shards (with your own BatchNorm update, if needed)"
        )
    averaging = [type(c).__name__ for c in callbacks if isinstance(c, WeightAveraging)]
    if len(averaging) > 1:
        raise MisconfigurationException(
            f"fsdp_custom supports one WeightAveraging callback at a time, got {averaging}: each writes the "
            "checkpoint's state_dict"
        )


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

# name -> (description, arguments): what both strategies register with their registries
STRATEGY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fsdp_custom": ("FSDP with the fsdp-strategy engine (FULL_SHARD)", {}),
    "fsdp_custom_cpu_offload": ("fsdp_custom with CPU offload", {"cpu_offload": True}),
    "fsdp_custom_shard_grad_op": ("fsdp_custom, SHARD_GRAD_OP", {"sharding_strategy": "SHARD_GRAD_OP"}),
    "fsdp_custom_no_shard": ("fsdp_custom, NO_SHARD (replicated, like DDP)", {"sharding_strategy": "NO_SHARD"}),
}


def options_from(arguments: Mapping[str, Any]) -> ShardingOptions:
    """``ShardingOptions.validate`` of the arguments named as its fields (``shard_model``'s or a
    strategy constructor's ``locals()``)."""
    return ShardingOptions.validate(**{name: arguments[name] for name in OPTION_NAMES})


_KEPT_BY_PLAN = ("sharding_strategy", "mixed_precision", "forward_prefetch", "backward_prefetch", "device_mesh")


class BudgetRequest(NamedTuple):
    """``auto_wrap_policy="auto"``: the settings are chosen by a memory plan ([Note: wrapping by
    budget] in ``plan/budget.py``) within ``budget`` bytes per rank, on one ``example_batch``."""

    budget: int
    example_batch: Any

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> BudgetRequest | None:
        """The request in a strategy's arguments, or None; a clear error for a half-given one."""
        from fsdp_strategy.plan.result import parse_bytes

        auto = isinstance(arguments["auto_wrap_policy"], str) and arguments["auto_wrap_policy"] == "auto"
        budget, batch = arguments.get("memory_budget"), arguments.get("example_batch")
        if not auto:
            if budget is not None or batch is not None:
                raise ValueError("memory_budget and example_batch are read with auto_wrap_policy='auto' only")
            return None
        if "memory_budget" not in arguments:
            raise ValueError(
                "auto_wrap_policy='auto' chooses settings before Trainer.fit creates the process group; in Fabric "
                "call fsdp_strategy.plan(model, batch, world_size=..., auto_wrap_policy='auto', memory_budget=...) "
                "before fabric.launch() and pass its plan.strategy_kwargs to the strategy"
            )
        if budget is None or batch is None:
            raise ValueError(
                "auto_wrap_policy='auto' needs memory_budget (bytes per rank, e.g. '70GiB') and example_batch (one "
                f"batch as training_step receives it; meta tensors work), got memory_budget={budget!r}"
            )
        given = [name for name in ("activation_checkpointing", "activation_checkpointing_policy") if arguments[name]]
        if given:
            raise ValueError(f"auto_wrap_policy='auto' chooses activation checkpointing itself; drop {given}")
        chosen = {"cpu_offload": arguments["cpu_offload"], "sharding_strategy": arguments["sharding_strategy"]}
        grad_op = ShardingStrategy.from_any(chosen["sharding_strategy"]) is ShardingStrategy.SHARD_GRAD_OP
        if chosen["cpu_offload"] not in (None, False) or grad_op:  # FULL_SHARD is the default: not "given"
            raise ValueError(
                f"auto_wrap_policy='auto' chooses cpu_offload and SHARD_GRAD_OP/FULL_SHARD itself; drop {chosen} "
                "(a HYBRID_SHARD or NO_SHARD sharding_strategy is kept)"
            )
        if arguments["ignored_modules"] is not None:
            raise ValueError("auto_wrap_policy='auto' plans a copy of the model, which ignored_modules cannot name")
        return cls(parse_bytes(budget), batch)

    def choose(self, model: Any, world_size: int, num_nodes: int, precision: str, given: dict[str, Any]) -> Any:
        """The MemoryPlan of the fastest settings that fit (every rank computes the same one)."""
        from fsdp_strategy.plan import plan

        kept = {name: given[name] for name in _KEPT_BY_PLAN if name in given}
        return plan(
            model,
            self.example_batch,
            world_size=world_size,
            num_nodes=num_nodes,
            precision=precision,
            auto_wrap_policy="auto",
            memory_budget=self.budget,
            **kept,
        )


class StrategyArguments:
    """The constructor arguments both strategies (Trainer and Fabric) take, checked once, kept
    under Lightning's names (read-only views of the sharding options) and private ones."""

    fsdp_keywords: tuple[str, ...] = tuple(FSDP_KEYWORDS)  # taken through **kwargs, as Lightning's FSDPStrategy

    def _choose_by_budget(self, model: Any, world_size: int, num_nodes: int, precision: str) -> Any:
        """``auto_wrap_policy="auto"``: plan, then take the chosen units, checkpointing, sharding
        strategy and offload as if given; returns the MemoryPlan. Costs: a few plans (seconds
        each for small models; see ``fsdp_strategy.plan``), on every rank alike."""
        assert self._budget is not None
        chosen = self._budget.choose(model, world_size, num_nodes, precision, self._given_options)
        arguments = {**self._given_options, **chosen.strategy_kwargs}
        self._options = options_from(arguments)
        for name in OPTION_NAMES:
            setattr(self, name, getattr(self._options, name))
        self.activation_checkpointing_policy = chosen.strategy_kwargs.get("activation_checkpointing_policy")
        self._budget = None
        return chosen

    def _take_arguments(self, arguments: Mapping[str, Any], async_save: bool = False) -> None:
        """Check ``arguments`` (the constructor's ``locals()``) and keep them; a bad one raises
        naming the argument, the value and what is accepted."""
        self._budget = BudgetRequest.from_arguments(arguments)
        if self._budget is not None:
            arguments = {**arguments, "auto_wrap_policy": None}  # chosen before the model is sharded
        self._options = options_from(arguments)
        self._given_options = {name: arguments[name] for name in (*OPTION_NAMES, "device_mesh")}
        for name in OPTION_NAMES:
            setattr(self, name, getattr(self._options, name))
        self.activation_checkpointing_policy = checkpointing_policy(
            arguments["activation_checkpointing"], arguments["activation_checkpointing_policy"]
        )
        self._state_dict_type = check_checkpoint_options(arguments["state_dict_type"], async_save)
        self._device_mesh = validate_device_mesh(arguments["device_mesh"], self._options.sharding_strategy)
        self._process_group_backend = check_backend(arguments["process_group_backend"])
        self._timeout = check_timeout(arguments["timeout"])
