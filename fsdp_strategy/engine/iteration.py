"""What the Scheduler tracks of one backward pass, and the autograd function that fires a unit's
post-backward (each unit's own state is in state.py)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_strategy.engine.unit import FSDPUnit


class PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs the unit's post-backward."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


@dataclass
class BackwardPass:
    """One backward pass in progress."""

    index: int  # the k-th backward of the iteration (its prefetch phase)
    create_graph: bool  # [Note: double backward] in state.py
    expected: deque[FSDPUnit]  # the reduction order ([Note: post-backward every rank agrees on])
    ready: set[FSDPUnit] = field(default_factory=set)  # units ready to reduce, waiting for their turn


def autograd_running() -> bool:
    """Whether autograd's engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1
