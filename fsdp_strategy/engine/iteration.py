"""What the Scheduler tracks within one iteration: forward calls on the stack, each unit's run,
the backward in progress, and the autograd function that fires a unit's post-backward."""

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
class Frame:
    """One call of a unit's forward."""

    exception: BaseException | None  # the exception being handled when the call began (usually None)
    counted: bool = False  # a post-backward was registered and counted for this call
    input_ids: frozenset[int] = frozenset()  # ids of the inputs as the forward saw them


@dataclass
class UnitRun:
    """What the Scheduler tracks for one unit within an iteration."""

    frames: list[Frame] = field(default_factory=list)  # forward calls on the stack
    post_backwards_due: int = 0  # post-backwards registered in forward and not yet fired
    ran_forward: bool = False  # started in the outermost forward in progress
    in_backward: bool = False  # backward reached it in the backward in progress
    reduced: bool = False  # its gradients were reduced (or stashed) in the backward in progress
    double_backward: bool = False  # [Note: double backward] in runtime.py
    uncovered_call: bool = False  # [Note: calls without a post-backward] in runtime.py
    backward_hook: Callable[[torch.Tensor], None] | None = None  # the pre-backward hook put on its outputs
    prefetch_after_backward: FSDPUnit | None = (
        None  # BACKWARD_POST: the unit to gather once this one's gradients are computed
    )

    def clear(self) -> None:
        """Forget the iteration (after a failure)."""
        self.frames.clear()
        self.post_backwards_due = 0
        self.ran_forward = self.in_backward = self.reduced = self.double_backward = self.uncovered_call = False
        self.prefetch_after_backward = None


@dataclass
class BackwardPass:
    """One backward pass in progress."""

    index: int  # the k-th backward of the iteration (its prefetch phase)
    create_graph: bool  # [Note: double backward] in runtime.py
    expected: deque[FSDPUnit]  # the reduction order ([Note: post-backward every rank agrees on])
    ready: set[int] = field(default_factory=set)  # ids of units ready to reduce, waiting for their turn


def autograd_running() -> bool:
    """Whether autograd's engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1
