"""Gradient clipping of a sharded model by the global norm: torch's utilities on this rank's
shards, and one all-reduce."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import torch
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
) -> torch.Tensor:
    """Clip the gradients of a model's ``sharded`` parameters (and its ``ignored_params``, this
    rank's own) by their global norm over ``shard_comm`` (see ``Scheduler.clip_grad_norm_``).
    Costs: a norm per gradient and one all-reduce of a scalar."""
    chosen = None if parameters is None else {id(p) for p in parameters}
    shards = [p.sharded for p in sharded if chosen is None or id(p.sharded) in chosen]
    ignored = [p for p in ignored_params.values() if chosen is None or id(p) in chosen]
    norm_type = float(norm_type)
    infinite = norm_type == float("inf")
    local = _total_norm([p.grad for p in shards if p.grad is not None], norm_type)
    total = (local if infinite else local.pow(norm_type)).to(device, copy=True)
    collectives.all_reduce(total, shard_comm, ctx, "clip_grad_norm", op="max" if infinite else "sum").wait()
    own = [p.grad for p in ignored if p.grad is not None]
    if own:  # this rank's own, as FSDP1 counts parameters it does not manage
        term = _total_norm(own, norm_type).to(total)
        total = torch.maximum(total, term) if infinite else total + term.pow(norm_type)
    if not infinite:
        total = total.pow(1.0 / norm_type)
    clip_grads_with_norm_([*shards, *ignored], max_norm, total)
    return total


def norm_dtype(grad: torch.Tensor) -> torch.dtype:
    """The dtype a gradient's norm is taken in: float32, or wider where the gradient is (float64, and
    complex128's float64): the gradients of a 16-bit model overflow float16 otherwise."""
    real = grad.dtype.to_real() if grad.is_complex() else grad.dtype
    return torch.promote_types(real, torch.float32)


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of ``grads`` together: torch's ``get_total_norm`` over each gradient's
    norm in ``norm_dtype`` (a complex gradient's norm is of its absolute values)."""
    norms = [
        torch.linalg.vector_norm(grad if grad.is_complex() else grad.to(norm_dtype(grad)), norm_type).to(
            norm_dtype(grad)
        )
        for grad in grads
    ]
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    widest = functools.reduce(torch.promote_types, (n.dtype for n in norms))
    return get_total_norm([n.to(widest) for n in norms], norm_type)
