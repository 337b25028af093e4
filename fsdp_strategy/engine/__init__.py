"""The FSDP engine: shard a module in place and schedule its collectives. Imports no Lightning.

    model = shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters())      # sees the shards
    loss = model(x).sum(); loss.backward(); optimizer.step()

Run under ``torchrun`` (or any initialized default process group); without one, the engine
runs as a group of one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_strategy.config import CPUOffload, MixedPrecision, ShardingStrategy, validate_device_mesh
from fsdp_strategy.engine.accounting import MemoryAccount
from fsdp_strategy.engine.collectives import CommGroup, CommLedger
from fsdp_strategy.engine.init import materialize, meta_tensor_names
from fsdp_strategy.engine.param import ParamUse, ShardedParam, ShardLayout
from fsdp_strategy.engine.runtime import Scheduler
from fsdp_strategy.engine.unit import FSDPUnit, UnitContext
from fsdp_strategy.wrap import as_policy_fn, select_unit_modules

__all__ = ["shard_model", "get_scheduler", "is_sharded", "comm_groups", "Scheduler"]

_SCHEDULER_ATTR = "_fsdp_custom_scheduler"


def comm_groups(
    sharding_strategy: ShardingStrategy, process_group: Any = None, device_mesh: Any = None
) -> tuple[CommGroup, CommGroup]:
    """The (shard, replicate) groups for a strategy: a 2-D mesh is ``(replicate, shard)``."""
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


def _param_uses(root: nn.Module) -> tuple[dict[int, list[ParamUse]], dict[int, str]]:
    uses: dict[int, list[ParamUse]] = defaultdict(list)
    names: dict[int, str] = {}
    seen: set[tuple[int, str]] = set()
    for prefix, module in root.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None or (id(module), name) in seen:
                continue
            seen.add((id(module), name))
            uses[id(param)].append(ParamUse(module, name))
            names.setdefault(id(param), f"{prefix}.{name}" if prefix else name)
    return uses, names


def _assign_params(unit_modules: list[nn.Module], uses: dict[int, list[ParamUse]]) -> dict[int, list[int]]:
    """Each parameter goes to the deepest unit whose subtree holds every module using it."""
    subtrees = [{id(m) for m in unit.modules()} for unit in unit_modules]
    assigned: dict[int, list[int]] = defaultdict(list)
    for param_id, param_uses in uses.items():
        owners = {id(use.module) for use in param_uses}
        index = max(i for i, subtree in enumerate(subtrees) if owners <= subtree)
        assigned[index].append(param_id)
    return assigned


def _modules_by_unit(root: nn.Module, unit_modules: list[nn.Module]) -> dict[int, list[nn.Module]]:
    """Unit index -> the modules whose nearest enclosing unit it is (deeper units win)."""
    nearest: dict[int, int] = {}
    for index, unit in enumerate(unit_modules):
        for module in unit.modules():
            nearest[id(module)] = index
    grouped: dict[int, list[nn.Module]] = defaultdict(list)
    for module in root.modules():
        grouped[nearest[id(module)]].append(module)
    return grouped


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
) -> nn.Module:
    """Shard ``module``'s parameters in place across the ranks and install the schedule.

    Each parameter keeps its name; at rest it is a dim-0 shard (see [Note: shard layout]).
    Modules still on the meta device are materialized unit by unit with ``reset_parameters``.
    Costs at rest: 1/N of the parameters plus padding; while running, the units gathered now.
    """
    if is_sharded(module):
        raise ValueError(f"{type(module).__name__} is already sharded; shard_model is applied once")
    strategy = ShardingStrategy.from_any(sharding_strategy)
    precision = MixedPrecision.from_any(mixed_precision) or MixedPrecision()
    offload = CPUOffload.from_any(cpu_offload)
    policy = as_policy_fn(auto_wrap_policy)
    shard_comm, replicate_comm = comm_groups(strategy, process_group, device_mesh)
    compute_device = torch.device(device) if device is not None else _default_device(module)
    storage_device = torch.device("cpu") if offload.offload_params else compute_device

    unit_modules = [module, *select_unit_modules(module, policy)]
    module_names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    uses, names = _param_uses(module)
    assigned = _assign_params(unit_modules, uses)
    modules_of = _modules_by_unit(module, unit_modules)
    layout = ShardLayout(shard_comm.rank, shard_comm.size, storage_device, compute_device, precision.param_dtype)
    ledger = CommLedger()
    memory = MemoryAccount()
    context = UnitContext(shard_comm, replicate_comm, precision.reduce_dtype, compute_device, ledger, memory)
    units: list[FSDPUnit] = []
    for index, unit_module in enumerate(unit_modules):
        owned = {id(m): m for m in modules_of[index]}
        owned.update({id(use.module): use.module for pid in assigned[index] for use in uses[pid]})
        materialize([(module_names[key], m) for key, m in owned.items()], compute_device)
        params = []
        for param_id in assigned[index]:
            first = uses[param_id][0]
            sharded = ShardedParam(names[param_id], first.module._parameters[first.name], uses[param_id], layout)
            sharded.install(unsharded=False)
            params.append(sharded)
        name = module_names[id(unit_module)] or "root"
        units.append(FSDPUnit(name, unit_module, params, context))
    leftover = meta_tensor_names(module)
    if leftover:
        raise ValueError(f"parameters left on the meta device: {leftover}; materialize them before sharding")
    _place_buffers(module, compute_device, precision.buffer_dtype)
    scheduler = Scheduler(units, strategy, precision, ledger, memory, compute_device, device_mesh)
    module.__dict__[_SCHEDULER_ATTR] = scheduler
    return module


def _default_device(module: nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def _place_buffers(root: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    for module in root.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                cast = dtype if (dtype is not None and buffer.is_floating_point()) else buffer.dtype
                module._buffers[name] = buffer.to(device=device, dtype=cast)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``shard_model`` was applied to ``module``."""
    return getattr(module, _SCHEDULER_ATTR, None) is not None


def get_scheduler(module: nn.Module) -> Scheduler:
    """The Scheduler that ``shard_model`` installed on ``module`` (the root)."""
    scheduler = getattr(module, _SCHEDULER_ATTR, None)
    if scheduler is None:
        raise ValueError(f"{type(module).__name__} was not sharded with shard_model()")
    return scheduler
