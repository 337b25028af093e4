"""Process group and device mesh setup shared by the Trainer and Fabric strategies.

Both strategies create the process group the same way (Lightning's ``_init_dist_connection``,
with NCCL's flight recorder on and, on gloo, the group destroyed at exit) and turn a
``(replicate, shard)`` pair into a DeviceMesh; this module is that code, once.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from fsdp_strategy.config import ShardingStrategy
from fsdp_strategy.distributed import rendezvous
from fsdp_strategy.engine import flight
from fsdp_strategy.options import init_process_group_kwargs


def set_world_ranks(strategy: Any) -> None:
    """Tell the cluster environment this process's global rank and the world size (node-major), and
    Lightning's rank-zero utilities the rank."""
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank


def mesh_shape(device_mesh: Any, sharding_strategy: ShardingStrategy, num_nodes: int, num_processes: int) -> Any:
    """The mesh to build: a hybrid strategy without one shards within a node (FSDP1's and Lightning's
    default); a ``(replicate, shard)`` pair must multiply to the world size."""
    if sharding_strategy.hybrid and device_mesh is None:
        device_mesh = (num_nodes, num_processes)
    world_size = num_nodes * num_processes
    if isinstance(device_mesh, tuple) and device_mesh[0] * device_mesh[1] != world_size:
        raise ValueError(
            f"device_mesh={device_mesh} multiplies to {device_mesh[0] * device_mesh[1]}, "
            f"but the world size is {world_size} (num_nodes x devices)"
        )
    return device_mesh


def connect(
    cluster_environment: ClusterEnvironment, backend: str | None, root_device: torch.device, timeout: timedelta | None
) -> str:
    """Create the process group (if none exists) on ``backend`` (default: the device's); returns the
    backend. Under torchrun's c10d rendezvous the group's keys go under a namespace of this attempt
    ([Note: one namespace per attempt] in rendezvous.py). Costs: one rendezvous."""
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    created_here = not _distributed_is_initialized()
    if "nccl" in backend:
        flight.enable_nccl_flight_recorder()
    kwargs = init_process_group_kwargs(root_device, timeout)
    on_attempt_store = created_here and rendezvous.shares_agent_store()
    if on_attempt_store:
        rank, world_size = cluster_environment.global_rank(), cluster_environment.world_size()
        address, port = cluster_environment.main_address, cluster_environment.main_port
        store = rendezvous.attempt_store(address, port, rank, world_size, timeout or dist.default_pg_timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
    else:
        _init_dist_connection(cluster_environment, backend, **kwargs)
    if backend != "nccl" or on_attempt_store:
        # Lightning registers this for NCCL groups it creates only; a gloo group (ours, or one another
        # strategy of this process created: DDP before us) left to interpreter shutdown can abort the
        # process ("terminate called without an active exception") or hang after a good run. Registered
        # once; destroying a destroyed group does nothing.
        atexit.unregister(_destroy_dist_connection)
        atexit.register(_destroy_dist_connection)
    return backend


def build_mesh(device_mesh: Any, device_type: str) -> Any:
    """A ``(replicate, shard)`` pair as a DeviceMesh with those dimension names; a mesh or None as given."""
    if not isinstance(device_mesh, tuple):
        return device_mesh
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, device_mesh, mesh_dim_names=("replicate", "shard"))
