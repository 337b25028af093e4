"""Gradient clipping of a sharded model by the global norm: torch's utilities on this rank's
shards, and one all-reduce (of two terms with tensor parallel: [Note: clipping across TP])."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.param import ShardedParam


@torch.no_grad()
def clip_grad_norm(
    sharded: list[ShardedParam],
    ignored_params: Mapping[str, torch.Tensor],
    shard_comm: CommGroup,
    ctx: CommContext,
    device: torch.device,
    max_norm: float,
    norm_type: float = 2.0,
    parameters: Iterable[torch.Tensor] | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients of a model's ``sharded`` parameters (and its ``ignored_params``, this
    rank's own) by their global norm over ``shard_comm`` (see ``Scheduler.clip_grad_norm_``).
    ``norm_type``: a positive number or inf, the norms whose shards' terms add up (or take the
    maximum); 0, negative numbers and -inf are refused. Costs: a norm per gradient and one
    all-reduce of a scalar."""
    norm_type = float(norm_type)
    if not norm_type > 0:  # NaN too
        raise ValueError(
            f"fsdp_custom: clip_grad_norm_ with norm_type={norm_type!r}: accepted: a positive number or inf "
            "(the norms a sum or maximum over every rank's shards gives); 0, negative orders and -inf are not "
            "computed across shards"
        )
    chosen = None if parameters is None else {id(p) for p in parameters}
    params = [p for p in sharded if chosen is None or id(p.sharded) in chosen]
    ignored = [p for p in ignored_params.values() if chosen is None or id(p) in chosen]
    infinite = norm_type == float("inf")
    split = [p.sharded.grad for p in params if p.sharded.grad is not None and p.tp is not None and p.tp.sharded]
    whole = [p.sharded.grad for p in params if p.sharded.grad is not None and (p.tp is None or not p.tp.sharded)]
    norms = (_total_norm(split, norm_type, device), _total_norm(whole, norm_type, device))
    dtype = torch.promote_types(*(n.dtype for n in norms))
    terms = torch.stack([n.to(device, dtype) for n in norms])
    if not infinite:
        terms = terms.pow(norm_type)
    tensor_comm = _tensor_comm(sharded)
    for comm in _groups_over(shard_comm, tensor_comm):
        collectives.all_reduce(terms, comm, ctx, "clip_grad_norm", op="max" if infinite else "sum").wait()
    replicas = 1.0 if infinite else float(tensor_comm.size)  # [Note: clipping across TP]
    total = torch.maximum(terms[0], terms[1]) if infinite else terms[0] + terms[1] / replicas
    own = [p.grad for p in ignored if p.grad is not None]
    if own:  # this rank's own, as FSDP1 counts parameters it does not manage
        term = _total_norm(own, norm_type, device).to(total)
        total = torch.maximum(total, term) if infinite else total + term.pow(norm_type)
    if not infinite:
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):  # torch's check, before any gradient changes
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped. To disable "
            "this error and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    clip_grads_with_norm_([*(p.sharded for p in params), *ignored], max_norm, total)
    return total


# [Note: clipping across TP]
# With tensor parallel, a gradient's shard is split over data parallel and, for a TP-split
# parameter, over TP too; a TP-replicated one (plain, or Replicate()) is the same on every TP peer.
# Both sums of |g|^p go in one tensor, summed over every rank that holds a different part: the split
# ones counted once each, the replicated ones once per TP peer, so divided by the TP size. That is
# one all-reduce where the data-parallel and TP ranks together are the default group (the
# strategies' mesh, or NO_SHARD's TP group alone), else one per group. FSDP2 crashes on a model with
# TP'd and plain modules mixed (pytorch#180346); here they are the two terms.


def _tensor_comm(sharded: list[ShardedParam]) -> CommGroup:
    """The tensor-parallel group of a model's parameters (a group of one without TP)."""
    spec = next((p.tp for p in sharded if p.tp is not None), None)
    return CommGroup.of(spec.mesh.get_group() if spec is not None and spec.size > 1 else None)


def _groups_over(shard_comm: CommGroup, tensor_comm: CommGroup) -> list[CommGroup]:
    """The groups one sum over the data-parallel shard group and the TP group runs on: one where
    they make up the default group (or one of them is a group of one), else both in turn."""
    if tensor_comm.size == 1:
        return [shard_comm]
    if shard_comm.size == 1:
        return [tensor_comm]
    if shard_comm.size * tensor_comm.size == dist.get_world_size():
        return [CommGroup.of(dist.group.WORLD)]
    return [shard_comm, tensor_comm]


def norm_dtype(grad: torch.Tensor) -> torch.dtype:
    """The dtype a gradient's norm is taken in: float32, or wider where the gradient is (float64, and
    complex128's float64): the gradients of a 16-bit model overflow float16 otherwise."""
    real = grad.dtype.to_real() if grad.is_complex() else grad.dtype
    return torch.promote_types(real, torch.float32)


def _total_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The ``norm_type``-norm of ``grads`` together: torch's ``get_total_norm`` over each gradient's
    norm in ``norm_dtype`` (a complex gradient's norm is of its absolute values); a zero on
    ``device`` where there are none (one made on the host would be copied to the GPU: a host wait)."""
    norms = [
        torch.linalg.vector_norm(grad if grad.is_complex() else grad.to(norm_dtype(grad)), norm_type).to(
            norm_dtype(grad)
        )
        for grad in grads
    ]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    widest = functools.reduce(torch.promote_types, (n.dtype for n in norms))
    return get_total_norm([n.to(widest) for n in norms], norm_type)
