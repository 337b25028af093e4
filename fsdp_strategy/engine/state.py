"""UnitState: one object per unit that says where it is in the iteration and what may happen next.

FSDP2 decides from one ``TrainingState`` per parameter group. A unit here has more to handle:
re-entry (a unit called again inside its own forward, or recomputed by activation
checkpointing), nested and double backward, calls whose inputs need no gradient, pinning by
``summon_full_params``. Every fact the Scheduler (runtime.py) acts on lives here, changes only
through a named transition, and is read through a named decision (``may_reshard``,
``needs_reduction``, ...). ``reset`` forgets a failed iteration in one call.

[Note: calls without a post-backward]
A call of a unit whose inputs need no gradient (token ids, real images for a critic) gets no
``PostBackward``, yet its weights get gradients. If the same unit is also called with inputs
that do, that call's post-backward says nothing about the other call's weight gradients (which
autograd may compute after it), so the unit is then reduced by the end-of-backward callback.

[Note: forward on the stack]
A unit whose forward is on the stack stays gathered, whatever runs inside it: backward
passes (Lightning's ``manual_backward``, ``torch.autograd.grad``), nested calls of the same
module with or without grad. Lightning runs ``training_step`` inside the root's forward.

[Note: double backward]
A backward run with ``create_graph=True`` (a gradient penalty, higher-order gradients)
builds nodes that read the weights of the units it ran through. Those units stay gathered
after it and are reduced and resharded at the end of the next backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any


class TrainingState(Enum):
    """What the step is doing with a unit."""

    IDLE = auto()  # not running: between steps, or its forward ended and backward has not reached it
    FORWARD = auto()  # its forward is on the stack (the root: for the whole root forward)
    PRE_BACKWARD = auto()  # backward reached its outputs: gathered, its gradients are being computed
    POST_BACKWARD = auto()  # its gradients were computed and it waits for (or had) its reduction


class AfterPostBackward(Enum):
    """What a unit's post-backward leads to."""

    KEEP = auto()  # [Note: double backward]: stays gathered, reduced at the next backward's end
    RESHARD = auto()  # another call of it may be ahead in backward: reshard; the end of backward reduces it
    READY = auto()  # reshard and reduce in its turn ([Note: post-backward every rank agrees on])


@dataclass
class Frame:
    """One call of a unit's forward."""

    exception: BaseException | None  # the exception being handled when the call began (usually None)
    counted: bool = False  # a post-backward was registered and counted for this call
    input_ids: frozenset[int] = frozenset()  # ids of the inputs as the forward saw them


class UnitState:
    """The iteration state of one unit (see the module docstring). Costs: a few attributes."""

    def __init__(self, is_root: bool) -> None:
        self.is_root = is_root
        self.phase = TrainingState.IDLE
        self.frames: list[Frame] = []  # forward calls on the stack
        self.post_backwards_due = 0  # post-backwards registered in forward and not yet fired
        self.ran_forward = False  # started in the outermost forward in progress
        self.in_backward = False  # backward reached it in the backward in progress
        self.reduced = False  # its gradients were reduced (or stashed) in the backward in progress
        self.double_backward = False  # [Note: double backward]
        self.uncovered_call = False  # [Note: calls without a post-backward]
        self.pinned = 0  # > 0 inside summon_full_params: nothing reshards it
        self.prefetch_after_backward: Any = None  # BACKWARD_POST: the unit to gather once its gradients exist
        self.exposed = False  # gathered where user code may change it ([Note: edits while gathered] in edits.py)

    # ---- transitions -------------------------------------------------------------------

    def forward_entered(self, frame: Frame, in_backward: bool) -> None:
        """A call of its forward begins (``in_backward``: a recomputation during backward)."""
        self.frames.append(frame)
        if not in_backward and self.phase is TrainingState.IDLE:
            self.phase = TrainingState.FORWARD

    def ran_in_forward_pass(self) -> None:
        """It started inside the outermost forward in progress (not a prefetch that missed)."""
        self.ran_forward = True

    def post_backward_armed(self, counted: bool) -> None:
        """Its inputs got a post-backward node (counted unless it is a recomputation's)."""
        self.post_backwards_due += counted

    def call_uncovered(self) -> None:
        """A call with grad whose inputs need no gradient ([Note: calls without a post-backward])."""
        self.uncovered_call = True

    def forward_exited(self) -> Frame | None:
        """A call of its forward returns (or raises); its frame, or None if ours never began."""
        if not self.frames:
            return None
        frame = self.frames.pop()
        if not self.frames and self.phase is TrainingState.FORWARD:
            self.phase = TrainingState.IDLE
        return frame

    def forward_raised(self, frame: Frame) -> None:
        """The call of ``frame`` raised: its post-backward will never fire."""
        self.post_backwards_due -= frame.counted

    def backward_reached(self) -> bool:
        """Backward reached its outputs; False if it already had in this backward."""
        if self.phase is TrainingState.PRE_BACKWARD:
            return False
        self.phase = TrainingState.PRE_BACKWARD
        self.in_backward = True
        return True

    def post_backward_fired(self, counted: bool, create_graph: bool) -> AfterPostBackward:
        """The gradients of its inputs were computed; says what follows."""
        self.post_backwards_due -= counted
        self.in_backward = True
        if create_graph or self.double_backward:
            self.double_backward = True
            return AfterPostBackward.KEEP
        if self.post_backwards_due > 0 or self.uncovered_call:
            self.phase = TrainingState.IDLE
            return AfterPostBackward.RESHARD
        self.phase = TrainingState.POST_BACKWARD
        return AfterPostBackward.READY

    def reduced_now(self) -> None:
        """Its gradients were reduced (or stashed) in this backward."""
        self.reduced = True

    def prefetch_when_computed(self, target: Any) -> None:
        """Gather ``target`` once this unit's gradients are computed (BACKWARD_POST)."""
        self.prefetch_after_backward = target

    def take_prefetch(self) -> Any:
        """The unit to gather now that its gradients are computed (BACKWARD_POST), once."""
        target, self.prefetch_after_backward = self.prefetch_after_backward, None
        return target

    def backward_finished(self, create_graph: bool) -> None:
        """The backward pass ended (its end-of-backward callback ran)."""
        if not create_graph:
            self.double_backward = False
        self.in_backward = self.reduced = self.uncovered_call = False
        self.prefetch_after_backward = None
        self.post_backwards_due = 0
        self.phase = TrainingState.FORWARD if self.frames else TrainingState.IDLE

    def forward_pass_finished(self) -> bool:
        """The outermost forward ended; True if it was gathered for it in vain (a prefetch that missed)."""
        missed = not self.ran_forward and not self.frames and not self.is_root
        self.ran_forward = False
        return missed and self.may_reshard()

    def expose(self) -> None:
        """It stays gathered where user code may change its full parameters (the root under
        ``training_step``, a unit kept past its forward): its reshard keeps every parameter's edits."""
        self.exposed = True

    def covered(self) -> bool:
        """It reshards: whether it was exposed since it was last gathered; no longer."""
        exposed, self.exposed = self.exposed, False
        return exposed

    def pin(self) -> None:
        """``summon_full_params`` holds it gathered."""
        self.pinned += 1

    def unpin(self) -> bool:
        """One ``summon_full_params`` lets go; True once none holds it."""
        self.pinned -= 1
        return not self.pinned

    def reset(self) -> None:
        """Forget the iteration (a failure): as just built."""
        self.__init__(self.is_root)

    # ---- decisions ---------------------------------------------------------------------

    @property
    def on_stack(self) -> bool:
        """Whether a call of its forward is in progress."""
        return bool(self.frames)

    def may_reshard(self) -> bool:
        """Whether it may give its full parameters up now ([Note: forward on the stack], pinning,
        [Note: double backward])."""
        return not self.pinned and not self.frames and not self.double_backward

    def reshards_after_forward(self, backward_due: bool, root_depth: int, reshard_after_forward: bool) -> bool:
        """Whether its last forward call returning releases it: not while backward is on it or
        pinned; the root once the whole root forward is done and no backward will use it; another
        unit unless its backward is due and the strategy keeps it (SHARD_GRAD_OP)."""
        if self.pinned or self.phase is TrainingState.PRE_BACKWARD or self.double_backward:
            return False
        if self.is_root:
            return root_depth == 0 and not backward_due
        return not backward_due or reshard_after_forward

    def needs_reduction(self, gathered: bool) -> bool:
        """Whether the end of backward must still reduce it: backward reached it, a double backward
        read it, or its forward is on the stack while gathered (a backward inside its forward)."""
        due = self.in_backward or self.double_backward or (self.on_stack and gathered)
        return due and not self.reduced

    def keeps_after_backward(self, create_graph: bool) -> bool:
        """Whether it stays gathered when a backward ends."""
        return bool(self.pinned or self.frames or (create_graph and self.double_backward))
