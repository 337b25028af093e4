"""The FSDP engine: shard a module in place and schedule its collectives. Imports no Lightning.

    model = shard_model(model, sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters())      # sees the shards
    loss = model(x).sum(); loss.backward(); optimizer.step()

Run under ``torchrun`` (or any initialized default process group); without one, the engine
runs as a group of one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_strategy.config import ShardingStrategy, validate_device_mesh
from fsdp_strategy.engine import build
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.exchange import agree_on_tag
from fsdp_strategy.engine.init import ParamInitFn
from fsdp_strategy.engine.monitoring import CollectiveMonitor
from fsdp_strategy.engine.runtime import Scheduler
from fsdp_strategy.engine.summon import summon_all_units
from fsdp_strategy.engine.tensor_parallel import check_replicas_agree, check_tensor_parallel, replicated_locals
from fsdp_strategy.engine.watchdog import CollectiveError, Watchdog
from fsdp_strategy.options import ShardingOptions, check_collective_timeout, options_from

__all__ = [
    "shard_model",
    "shard_with_options",
    "Watchdog",
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
    optimizer_updates: dict | None = None,
    watchdog: Watchdog | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters in place across the ranks and install the schedule.

    Each parameter keeps its name; at rest it is a dim-0 shard (see [Note: shard layout]) and
    belongs to the lowest unit common to every place it is used ([Note: lowest common unit]).
    Modules still on the meta device are materialized unit by unit (see ``engine/init.py``;
    ``param_init_fn`` has FSDP1's meaning). ``forward_prefetch``/``backward_prefetch``: which
    all-gathers are issued ahead of their unit (see ``Prefetch``). ``sync_module_states``: every
    parameter and buffer takes global rank 0's value before sharding (one broadcast each).
    ``ignored_modules``: left whole and unsynchronized on every rank ([Note: ignored modules]).
    ``watchdog``: the ``Watchdog`` that watches this model's collectives ([Note: watchdog]); by
    default one of its own is started (with ``collective_timeout``: seconds or a timedelta; None:
    the process group's own timeout; ``math.inf``: no limit) and closed by the Scheduler's
    ``close()``; pass one to share it between models. ``check_collective_order``: stamp every
    collective so ranks that issue different ones stop at the first ([Note: order stamps]).
    ``optimizer_updates``: ``{optimizer class: "elementwise" | "whole_matrix"}`` for optimizers the
    engine does not know ([Note: trust by allow-list] in optimizer_kinds.py; torch's Muon is placed
    whole, [Note: whole-matrix placement] in whole_matrix.py).
    Costs at rest: 1/N of the parameters plus padding; while running, the units gathered now.
    """
    options = options_from(locals())
    owned = None
    if watchdog is None:
        watchdog = owned = Watchdog.start(options.collective_timeout)
    try:
        scheduler = shard_with_options(module, options, device, process_group, device_mesh, watchdog)
    except BaseException:
        if owned is not None:
            owned.close()
        raise
    scheduler.owned_watchdog = owned
    return module


def shard_with_options(
    module: nn.Module,
    options: ShardingOptions,
    device: torch.device | str | None = None,
    process_group: Any = None,
    device_mesh: Any = None,
    watchdog: Watchdog | None = None,
) -> Scheduler:
    """``shard_model`` with validated options (the strategies' path): plan, build, schedule."""
    if is_sharded(module):
        raise ValueError(f"{type(module).__name__} is already sharded; shard_model is applied once")
    shard_comm, replicate_comm = comm_groups(options.sharding_strategy, process_group, device_mesh)
    hybrid, synced = options.sharding_strategy.hybrid, options.sync_module_states
    tensor_mesh = check_tensor_parallel(module, shard_comm, replicate_comm, hybrid, synced, options.ignored_modules)
    on_meta = {name for name, local in replicated_locals(module) if local.is_meta} if tensor_mesh and not synced else ()
    compute = build.compute_device(device, module, shard_comm.group)
    storage = torch.device("cpu") if options.cpu_offload.offload_params else compute
    where = build.Where(shard_comm, replicate_comm, compute, storage, device_mesh)
    comm = CommContext(CollectiveMonitor(watchdog=watchdog), tag=agree_on_tag(shard_comm.group))
    sharding = build.plan(module, options)
    units = build.build(module, sharding, options, where, comm)
    scheduler = build.schedule(module, units, sharding, options, where, comm)
    if on_meta:  # TP peers hold the same rows of a replicated parameter: their shards must agree
        shards = [(p.fqn, p.sharded) for p in scheduler.sharded_params() if p.fqn in on_meta]
        try:
            check_replicas_agree(shards, tensor_mesh, materialized=True)
        except ValueError:
            scheduler.close()
            raise
    module.__dict__[SCHEDULER_ATTRIBUTE] = scheduler
    return scheduler


def is_sharded(module: nn.Module) -> bool:
    """Whether ``shard_model`` was applied to ``module``."""
    return getattr(module, SCHEDULER_ATTRIBUTE, None) is not None


@contextmanager
def summon_full_params(module: nn.Module, writeback: bool = False) -> Iterator[nn.Module]:
    """Gather the whole sharded model for code outside ``forward()`` (FSDP1's ``summon_full_params``).

    Inside, every module holds its full parameters (in ``param_dtype``), so ``generate()`` or any
    submodule call works; ``writeback=True`` copies changes back into the shards on exit; without it
    a change is discarded where sharded (kept where one rank holds the parameter whole) and named
    in a warning ([Note: summon without writeback]). A collective: every rank enters it. Costs: the
    full model on every rank while inside.
    """
    with summon_all_units(get_scheduler(module), writeback=writeback):
        yield module


def get_scheduler(module: nn.Module) -> Scheduler:
    """The Scheduler that ``shard_model`` installed on ``module`` (the root)."""
    scheduler = getattr(module, SCHEDULER_ATTRIBUTE, None)
    if scheduler is None:
        raise ValueError(f"{type(module).__name__} was not sharded with shard_model()")
    return scheduler
