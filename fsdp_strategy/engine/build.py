"""Building a sharded model: plan the units, build them (materializing meta tensors unit by unit),
and install the schedule. ``shard_model`` (``engine/__init__.py``) is these three steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_strategy.config import MixedPrecision
from fsdp_strategy.engine import control
from fsdp_strategy.engine.accounting import MemoryAccount
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.device import device_layer
from fsdp_strategy.engine.edits import LostEdits
from fsdp_strategy.engine.flight import STAMP_SLOTS
from fsdp_strategy.engine.guard import install_guards
from fsdp_strategy.engine.ignored import Ignored, find_ignored
from fsdp_strategy.engine.init import materialize, meta_tensor_names, post_order, weight_initializers
from fsdp_strategy.engine.order import Prefetch
from fsdp_strategy.engine.param import ShardedParam, ShardLayout
from fsdp_strategy.engine.placement import Placement, plan_units
from fsdp_strategy.engine.runtime import Scheduler
from fsdp_strategy.engine.unit import FSDPUnit, UnitContext
from fsdp_strategy.engine.unsupported import refuse_unsupported_modules
from fsdp_strategy.options import ShardingOptions
from fsdp_strategy.wrap import select_unit_modules


class Where(NamedTuple):
    """Where a model runs: its groups, the compute device and where shards are stored."""

    shard_comm: CommGroup
    replicate_comm: CommGroup
    device: torch.device  # where full parameters and collectives live
    storage: torch.device  # where shards live (the CPU with offload)
    mesh: Any  # the HSDP (replicate, shard) DeviceMesh, if any


class Plan(NamedTuple):
    """Which modules become units and what each owns, before anything is allocated."""

    unit_modules: list[nn.Module]  # the root first
    placement: Placement
    ignored: Ignored


def plan(module: nn.Module, options: ShardingOptions) -> Plan:
    """Choose the units (the root and what the wrap policy selects) and place every parameter."""
    ignored = find_ignored(module, options.ignored_modules)
    selected = select_unit_modules(module, options.wrap_policy)
    unit_modules = [module, *(m for m in selected if id(m) not in ignored.module_ids)]
    return Plan(unit_modules, plan_units(module, unit_modules, skip=ignored.module_ids), ignored)


def build(module: nn.Module, sharding: Plan, options: ShardingOptions, where: Where, comm: CommContext) -> list:
    """Materialize, (optionally) synchronize and shard unit by unit; return the units, root first.
    Peak memory: about one unit's full size beyond the shards."""
    refuse_unsupported_modules(module, sharding.ignored.module_ids, where.shard_comm.size)
    precision = options.mixed_precision or MixedPrecision()
    distributed = where.shard_comm.size > 1 or where.replicate_comm.size > 1
    slots = STAMP_SLOTS if options.check_collective_order and distributed else 0
    shard_comm = where.shard_comm
    layer = device_layer(where.device, where.storage, options.cpu_offload.offload_params)
    layout = ShardLayout(shard_comm.rank, shard_comm.size, where.storage, where.device, precision.param_dtype, layer)
    context = UnitContext(
        shard_comm,
        where.replicate_comm,
        precision.reduce_dtype,
        where.device,
        comm,
        MemoryAccount(),
        layer,
        lost_edits=LostEdits([shard_comm, where.replicate_comm], comm, where.device),
        stamp_slots=slots,
    )
    initializers, order = weight_initializers(module), post_order(module)
    names = {id(m): name for name, m in module.named_modules()}
    units = []
    for index, unit_module in enumerate(sharding.unit_modules):
        owned = _owned_modules(sharding.placement, index, names)
        materialize(owned, where.device, options.param_init_fn, initializers, sharding.placement.uses, order)
        params = _shard_params(sharding.placement, index, layout, options, comm, where)
        units.append(FSDPUnit(sharding.placement.unit_names[index], unit_module, params, context, index == 0))
    leftover = meta_tensor_names(module)
    if leftover:
        raise ValueError(f"parameters left on the meta device: {leftover}; materialize them before sharding")
    return units


def _owned_modules(placement: Placement, index: int, names: dict[int, str]) -> list[tuple[str, nn.Module]]:
    """The modules unit ``index`` materializes: its own, and every module using one of its parameters."""
    owned = {id(m): (name, m) for name, m in placement.modules[index]}
    for param_id in placement.params[index]:
        for use in placement.uses[param_id]:
            owned.setdefault(id(use.module), (names[id(use.module)], use.module))
    return list(owned.values())


def _shard_params(
    placement: Placement, index: int, layout: ShardLayout, options: ShardingOptions, comm: CommContext, where: Where
) -> list[ShardedParam]:
    """Shard unit ``index``'s parameters (rank 0's values first with ``sync_module_states``; a
    tensor-parallel one's local block from the first rank of its data-parallel group)."""
    firsts = [placement.uses[param_id][0] for param_id in placement.params[index]]
    if options.sync_module_states:
        values = [use.module._parameters[use.name] for use in firsts]
        dog = control.watchdog_of(comm)
        plain = [value for value in values if not isinstance(value, DTensor)]
        control.broadcast_from_rank0(plain, layout.compute_device, dog)
        blocks = [value.to_local() for value in values if isinstance(value, DTensor)]
        data = where.shard_comm if where.shard_comm.size > 1 else where.replicate_comm
        if data.size > 1:  # one data-parallel rank: its block is the one (group None would be every rank)
            control.broadcast_from_rank0(blocks, layout.compute_device, dog, data.group)
    params = []
    for param_id, first in zip(placement.params[index], firsts):
        current = first.module._parameters[first.name]
        sharded = ShardedParam(placement.param_names[param_id], current, placement.uses[param_id], layout)
        sharded.install(unsharded=False)
        params.append(sharded)
    return params


def schedule(
    module: nn.Module, units: list[FSDPUnit], sharding: Plan, options: ShardingOptions, where: Where, comm: CommContext
) -> Scheduler:
    """Place the buffers and ignored modules, and install the Scheduler's hooks and the guards."""
    ignored = sharding.ignored
    for root in ignored.roots:
        root.to(where.device)
    precision = options.mixed_precision or MixedPrecision()
    buffer_dtypes = place_buffers(module, where.device, precision.buffer_dtype, ignored.module_ids)
    if options.sync_module_states:  # after placement: the buffers are where the collectives run
        buffers = [b for b in module.buffers() if b is not None]
        control.broadcast_from_rank0([*ignored.params.values(), *buffers], where.device, control.watchdog_of(comm))
    prefetch = Prefetch(options.forward_prefetch, options.backward_prefetch)
    return Scheduler(
        units,
        options.sharding_strategy,
        precision,
        comm,
        units[0].memory,
        where.device,
        where.mesh,
        prefetch,
        options.optimizer_updates,
        saved_buffer_dtypes=buffer_dtypes,
        ignored_params=ignored.params,
        guards=install_guards(module, units),  # [Note: loud misuse]; the Scheduler's own hooks come first
    )


def compute_device(device: torch.device | str | None, module: nn.Module, group: Any) -> torch.device:
    """Where a model computes: ``device`` with its index (``"cuda"`` is the current CUDA device, as
    tensors created there report it); without one, the device of the model's first tensor on an
    accelerator; else, when ``group``'s collectives include NCCL (``"nccl"`` or a mixed
    ``"cpu:gloo,cuda:nccl"``), the current CUDA device (FSDP2's choice: a model built on the CPU
    moves there); else the CPU."""
    if device is not None:
        chosen = torch.device(device)
        if chosen.type == "cuda" and chosen.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return chosen
    for tensor in [*module.parameters(), *module.buffers()]:
        if not tensor.is_meta and tensor.device.type != "cpu":
            return tensor.device
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def place_buffers(
    root: nn.Module, device: torch.device, dtype: torch.dtype | None, ignored: frozenset[int]
) -> dict[str, torch.dtype]:
    """Move buffers to ``device``, floating ones cast to ``dtype`` (not in ``ignored`` modules);
    return the original dtypes of the cast ones."""
    original = {}
    placed: dict[int, torch.Tensor] = {}  # a buffer registered in several modules stays one tensor
    for module_name, module in root.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None:
                castable = dtype is not None and buffer.is_floating_point() and id(module) not in ignored
                cast = dtype if castable else buffer.dtype
                if cast != buffer.dtype:
                    original[f"{module_name}.{name}" if module_name else name] = buffer.dtype
                if id(buffer) not in placed:
                    placed[id(buffer)] = buffer.to(device=device, dtype=cast)
                module._buffers[name] = placed[id(buffer)]
    return original
