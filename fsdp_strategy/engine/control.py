"""The engine's blocking control-plane calls: object gathers, small all-reduces and all-gathers,
broadcasts at setup, barriers, and the side groups they run on.

They serve checkpoints, setup (``sync_module_states``), SyncBatchNorm and the optimizer checks,
not the training step's data plane (collectives.py), and each runs under the watchdog it is given
(``watched``: a record in the flight recorder, a timeout, a failure naming where every rank was).
Costs: one blocking collective each, pickling for the object calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_strategy.engine.collectives import CommContext
from fsdp_strategy.engine.monitoring import CollectiveMonitor, watched
from fsdp_strategy.engine.watchdog import Watchdog


def watchdog_of(ctx: CommContext) -> Watchdog | None:
    """The watchdog that watches ``ctx``'s collectives, which its blocking calls report to too (None: unwatched)."""
    return ctx.observer.watchdog if isinstance(ctx.observer, CollectiveMonitor) else None


def process_rank(group: Any = None) -> tuple[int, int]:
    """(rank, size) in ``group``, or (0, 1) without a process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_objects(value: Any, group: Any = None, dog: Watchdog | None = None) -> list[Any]:
    """Every rank's ``value`` (pickled), in rank order; blocking (watched by ``dog``)."""
    _, size = process_rank(group)
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    with watched("all_gather_object", "checkpoint", dog):
        dist.all_gather_object(out, value, group=group)
    return out


def gather_objects(value: Any, group: Any = None, dog: Watchdog | None = None) -> list[Any] | None:
    """Every rank's ``value`` (pickled) on the group's first rank, in rank order (None elsewhere); blocking."""
    rank, size = process_rank(group)
    if size == 1:
        return [value]
    out: list[Any] | None = [None] * size if rank == 0 else None
    with watched("gather_object", "checkpoint", dog):
        dist.gather_object(value, out, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return out


def all_gather_rows(
    tensor: torch.Tensor, group: Any = None, dog: Watchdog | None = None, what: str = "sync_batchnorm"
) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order, shape ``(world, *tensor.shape)``; blocking
    (``what`` names it in a watchdog's report)."""
    _, size = process_rank(group)
    if size == 1:
        return tensor.unsqueeze(0).clone()
    out = tensor.new_empty(size * tensor.numel())
    with watched("all_gather", what, dog):
        dist.all_gather_into_tensor(out, tensor.reshape(-1).contiguous(), group=group)
    return out.view(size, *tensor.shape)


def all_reduce_sum_(tensor: torch.Tensor, group: Any = None, dog: Watchdog | None = None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in place; blocking (no-op for one rank)."""
    if process_rank(group)[1] > 1:
        with watched("all_reduce", "sync_batchnorm", dog):
            dist.all_reduce(tensor, group=group)
    return tensor


@torch.no_grad()
def broadcast_from_rank0(
    tensors: list[torch.Tensor], device: torch.device, dog: Watchdog | None = None, group: Any = None
) -> None:
    """Overwrite ``tensors`` in place with the values of ``group``'s first rank (default: global rank 0)
    (``sync_module_states``); blocking. The broadcast runs on ``device``, where the collectives live
    (NCCL takes CUDA tensors only): a tensor elsewhere (a model built on the CPU) goes through a copy
    there and back.

    Costs: one broadcast per tensor (setup only), plus those copies. No-op for a group of one.
    """
    if process_rank(group)[1] == 1:
        return
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with watched("broadcast", "sync_module_states", dog):
        for tensor in tensors:
            if tensor.device == device:
                dist.broadcast(tensor.data, src=source, group=group)
            else:
                staged = tensor.detach().to(device)
                dist.broadcast(staged, src=source, group=group)
                tensor.data.copy_(staged)


def barrier(group: Any = None, dog: Watchdog | None = None) -> None:
    """Wait until every rank of ``group`` arrives (no-op without a process group)."""
    if dist.is_initialized():
        with watched("barrier", "checkpoint", dog):
            dist.barrier(group=group)


def new_gloo_group() -> Any:
    """A new gloo group of all ranks (a collective: every rank calls it), or None without one."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def destroy_group(group: Any) -> None:
    """Release a group made by ``new_gloo_group``."""
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)
