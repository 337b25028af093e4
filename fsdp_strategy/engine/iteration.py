"""What the Scheduler tracks of one iteration (``Step``) and of one backward pass in it
(``BackwardPass``), and the autograd function that fires a unit's post-backward (each unit's own
state is in state.py; what outlives an iteration, the prefetch order and the reduction order, is in
order.py and reductions.py).

One iteration, as the Scheduler (runtime.py) runs it:
- the root's outermost forward pre-hook starts it (resetting a failed previous one);
- a unit's forward pre-hook gathers it, prefetches the next unit ([Note: prefetch from the
  previous run]) and, with grad enabled, applies ``PostBackward`` to its inputs that require
  grad; its post-hook reshards it by policy and hooks its outputs for backward;
- the pre-backward hook (on the outputs) gathers it again and prefetches;
- ``PostBackward`` fires when the gradients of the unit's forward inputs are computed
  ([Note: post-backward every rank agrees on] in reductions.py) and reduces and reshards the unit;
- a callback queued at the end of every backward reduces, in one fixed unit order, the units
  that ran in this backward without a post-backward, settles every reduction and reshards.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._pytree import tree_map


class PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs the unit's post-backward.

    An input that is a tensor-parallel module's local output still in flight (an
    ``AsyncCollectiveTensor``) comes out waited for, a plain tensor: a compiled unit fed one passed
    it no gradient inside torch 2.13 ([Note: compiled tensor-parallel blocks] in
    tensor_parallel.py). Costs: nothing more than the wait its first use would make."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(x.wait() if isinstance(x, AsyncCollectiveTensor) else x for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


@dataclass
class BackwardPass:
    """One backward pass in progress."""

    index: int  # the k-th backward of the iteration (its prefetch phase)
    create_graph: bool  # [Note: double backward] in state.py
    expected: deque[Any]  # FSDPUnits: the reduction order ([Note: post-backward every rank agrees on])
    ready: set[Any] = field(default_factory=set)  # units ready to reduce, waiting for their turn


@dataclass
class Step:
    """One iteration, from a root forward's start to the next one's: a new iteration is a new
    ``Step``, nothing reset by hand. Costs: one object per iteration."""

    forward_phase: tuple | None = None  # ("forward", grad enabled) while the outermost root forward runs
    root_depth: int = 0  # root forwards on the stack (a nested or recomputed one included)
    backwards: int = 0  # backward passes begun in this iteration
    backward: BackwardPass | None = None  # the one in progress
    post_forward_order: list[Any] = field(default_factory=list)  # FSDPUnits with hooked outputs, in order


def autograd_running() -> bool:
    """Whether autograd's engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype | None) -> tuple[tuple, dict]:
    """The root forward's floating-point tensor inputs (at any depth) cast to ``dtype``, the
    ``param_dtype`` of mixed precision (None: as they are). Costs: one cast per such tensor."""
    if dtype is None:
        return args, kwargs

    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return tree_map(cast, args), tree_map(cast, kwargs)
