"""The FSDP engine: shard a module in place and schedule its collectives. Imports no Lightning.

    model = shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters())      # sees the shards
    loss = model(x).sum(); loss.backward(); optimizer.step()

Run under ``torchrun`` (or any initialized default process group); without one, the engine
runs as a group of one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_strategy.config import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, validate_device_mesh
from fsdp_strategy.engine import collectives, watchdog
from fsdp_strategy.engine.accounting import MemoryAccount
from fsdp_strategy.engine.collectives import CommGroup, CommLedger
from fsdp_strategy.engine.flight import STAMP_SLOTS
from fsdp_strategy.engine.guard import install_guards
from fsdp_strategy.engine.ignored import find_ignored
from fsdp_strategy.engine.init import ParamInitFn, materialize, meta_tensor_names, post_order, weight_initializers
from fsdp_strategy.engine.order import Prefetch
from fsdp_strategy.engine.param import ShardedParam, ShardLayout
from fsdp_strategy.engine.placement import plan_units
from fsdp_strategy.engine.runtime import Scheduler
from fsdp_strategy.engine.summon import summon_all_units
from fsdp_strategy.engine.unit import FSDPUnit, UnitContext
from fsdp_strategy.engine.watchdog import CollectiveError
from fsdp_strategy.wrap import as_policy_fn, select_unit_modules

__all__ = [
    "shard_model",
    "get_scheduler",
    "is_sharded",
    "comm_groups",
    "summon_full_params",
    "Scheduler",
    "CollectiveError",
    "check_collective_timeout",
]

SCHEDULER_ATTRIBUTE = "_fsdp_custom_scheduler"  # where shard_model keeps the Scheduler on the root module


def comm_groups(
    sharding_strategy: ShardingStrategy, process_group: Any = None, device_mesh: Any = None
) -> tuple[CommGroup, CommGroup]:
    """The (shard, replicate) groups for a strategy: a 2-D mesh is ``(replicate, shard)``."""
    if sharding_strategy.hybrid and device_mesh is None:
        raise ValueError(
            f"sharding_strategy={sharding_strategy.value!r} needs device_mesh: a 2-D (replicate, shard) DeviceMesh"
        )
    if validate_device_mesh(device_mesh, sharding_strategy) is not None:
        if isinstance(device_mesh, tuple):
            raise TypeError(f"shard_model needs a DeviceMesh, got {device_mesh!r}; build one with init_device_mesh")
        if device_mesh.ndim != 2:
            raise ValueError(f"device_mesh must be 2-D (replicate, shard), got {device_mesh.ndim} dimensions")
        return CommGroup.of(device_mesh.get_group(1)), CommGroup.of(device_mesh.get_group(0))
    if not dist.is_initialized():
        return CommGroup.of(None), CommGroup.of(None)
    group = CommGroup.of(process_group or dist.group.WORLD)
    if sharding_strategy is ShardingStrategy.NO_SHARD:
        return CommGroup.of(None), group
    return group, CommGroup.of(None)


def shard_model(
    module: nn.Module,
    *,
    sharding_strategy: Any = "FULL_SHARD",
    auto_wrap_policy: Any = None,
    mixed_precision: Any = None,
    cpu_offload: Any = None,
    device: torch.device | str | None = None,
    process_group: Any = None,
    device_mesh: Any = None,
    param_init_fn: ParamInitFn | None = None,
    forward_prefetch: bool = True,
    backward_prefetch: Any = "BACKWARD_PRE",
    sync_module_states: bool = False,
    ignored_modules: Iterable[nn.Module] | None = None,
    collective_timeout: float | timedelta | None = None,
    check_collective_order: bool = True,
) -> nn.Module:
    """Shard ``module``'s parameters in place across the ranks and install the schedule.

    Each parameter keeps its name; at rest it is a dim-0 shard (see [Note: shard layout]) and
    belongs to the lowest unit common to every place it is used ([Note: lowest common unit]).
    Modules still on the meta device are materialized unit by unit (see ``engine/init.py``;
    ``param_init_fn`` has FSDP1's meaning). ``forward_prefetch``/``backward_prefetch``: which
    all-gathers are issued ahead of their unit (see ``Prefetch``). ``sync_module_states``: every
    parameter and buffer takes global rank 0's value before sharding (one broadcast each).
    ``ignored_modules``: left whole and unsynchronized on every rank ([Note: ignored modules]).
    ``collective_timeout`` (seconds or a timedelta; None: the process group's own timeout;
    ``math.inf``: no limit): an engine collective waiting longer ends the job on every rank with a
    report of where each rank was ([Note: watchdog]).
    ``check_collective_order``: stamp every collective so ranks that issue different ones stop
    at the first ([Note: order stamps]).
    Costs at rest: 1/N of the parameters plus padding; while running, the units gathered now.
    """
    if is_sharded(module):
        raise ValueError(f"{type(module).__name__} is already sharded; shard_model is applied once")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn must be a callable (module) -> None, got {param_init_fn!r}")
    strategy = ShardingStrategy.from_any(sharding_strategy)
    precision = MixedPrecision.from_any(mixed_precision) or MixedPrecision()
    offload = CPUOffload.from_any(cpu_offload)
    policy = as_policy_fn(auto_wrap_policy)
    if not isinstance(forward_prefetch, bool):
        raise TypeError(f"forward_prefetch must be a bool, got {forward_prefetch!r}")
    if not isinstance(sync_module_states, bool):
        raise TypeError(f"sync_module_states must be a bool, got {sync_module_states!r}")
    prefetch = Prefetch(forward_prefetch, BackwardPrefetch.from_any(backward_prefetch))
    timeout = check_collective_timeout(collective_timeout)
    if not isinstance(check_collective_order, bool):
        raise TypeError(f"check_collective_order must be a bool, got {check_collective_order!r}")
    shard_comm, replicate_comm = comm_groups(strategy, process_group, device_mesh)
    watchdog.start(timeout)
    distributed = shard_comm.size > 1 or replicate_comm.size > 1
    stamp_slots = STAMP_SLOTS if check_collective_order and distributed else 0
    compute_device = torch.device(device) if device is not None else _default_device(module)
    storage_device = torch.device("cpu") if offload.offload_params else compute_device

    ignored = find_ignored(module, ignored_modules)
    unit_modules = [module, *(m for m in select_unit_modules(module, policy) if id(m) not in ignored.module_ids)]
    placement = plan_units(module, unit_modules, skip=ignored.module_ids)
    initializers = weight_initializers(module)
    order = post_order(module)
    module_names = {id(m): name for name, m in module.named_modules()}
    layout = ShardLayout(shard_comm.rank, shard_comm.size, storage_device, compute_device, precision.param_dtype)
    ledger = CommLedger()
    memory = MemoryAccount()
    context = UnitContext(
        shard_comm, replicate_comm, precision.reduce_dtype, compute_device, ledger, memory, stamp_slots
    )
    units: list[FSDPUnit] = []
    for index, unit_module in enumerate(unit_modules):
        owned = {id(m): (name, m) for name, m in placement.modules[index]}
        for param_id in placement.params[index]:
            for use in placement.uses[param_id]:
                owned.setdefault(id(use.module), (module_names[id(use.module)], use.module))
        materialize(list(owned.values()), compute_device, param_init_fn, initializers, placement.uses, order)
        if sync_module_states:
            collectives.broadcast_from_rank0(
                [use.module._parameters[use.name] for use in _first_uses(placement, index)]
            )
        params = []
        for param_id in placement.params[index]:
            uses = placement.uses[param_id]
            current = uses[0].module._parameters[uses[0].name]
            sharded = ShardedParam(placement.param_names[param_id], current, uses, layout)
            sharded.install(unsharded=False)
            params.append(sharded)
        units.append(FSDPUnit(placement.unit_names[index], unit_module, params, context))
    leftover = meta_tensor_names(module)
    if leftover:
        raise ValueError(f"parameters left on the meta device: {leftover}; materialize them before sharding")
    for root in ignored.roots:
        root.to(compute_device)
    if sync_module_states:
        collectives.broadcast_from_rank0([*ignored.params.values(), *(b for b in module.buffers() if b is not None)])
    buffer_dtypes = _place_buffers(module, compute_device, precision.buffer_dtype, ignored.module_ids)
    scheduler = Scheduler(units, strategy, precision, ledger, memory, compute_device, device_mesh, prefetch)
    scheduler.saved_buffer_dtypes = buffer_dtypes
    scheduler.ignored_params = ignored.params
    scheduler.hook_handles += install_guards(module, units)
    module.__dict__[SCHEDULER_ATTRIBUTE] = scheduler
    return module


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


def _first_uses(placement: Any, index: int) -> list:
    return [placement.uses[param_id][0] for param_id in placement.params[index]]


def _default_device(module: nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def _place_buffers(
    root: nn.Module, device: torch.device, dtype: torch.dtype | None, ignored: frozenset[int]
) -> dict[str, torch.dtype]:
    """Move buffers to ``device``, floating ones cast to ``dtype`` (not in ``ignored`` modules);
    return the original dtypes of the cast ones."""
    original = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None:
                castable = dtype is not None and buffer.is_floating_point() and id(module) not in ignored
                cast = dtype if castable else buffer.dtype
                if cast != buffer.dtype:
                    original[f"{module_name}.{name}" if module_name else name] = buffer.dtype
                module._buffers[name] = buffer.to(device=device, dtype=cast)
    return original


def is_sharded(module: nn.Module) -> bool:
    """Whether ``shard_model`` was applied to ``module``."""
    return getattr(module, SCHEDULER_ATTRIBUTE, None) is not None


@contextmanager
def summon_full_params(module: nn.Module, writeback: bool = False) -> Iterator[nn.Module]:
    """Gather the whole sharded model for code outside ``forward()`` (FSDP1's ``summon_full_params``).

    Inside, every module holds its full parameters (in ``param_dtype``), so ``generate()`` or any
    submodule call works; ``writeback=True`` copies changes back into the shards on exit. A
    collective: every rank enters it. Costs: the full model on every rank while inside.
    """
    with summon_all_units(get_scheduler(module), writeback=writeback):
        yield module


def get_scheduler(module: nn.Module) -> Scheduler:
    """The Scheduler that ``shard_model`` installed on ``module`` (the root)."""
    scheduler = getattr(module, SCHEDULER_ATTRIBUTE, None)
    if scheduler is None:
        raise ValueError(f"{type(module).__name__} was not sharded with shard_model()")
    return scheduler
