"""ExecutionOrder: which unit to prefetch, from the order the previous run of a phase took.

[Note: prefetch from the previous run]
A phase is one outermost forward (with or without grad) or the k-th backward of an
iteration. Each run of a phase records the units in the order they started; the next run of
the same phase prefetches, at its i-th unit, the unit the previous run started at i+1, as long
as it has followed the previous run so far. A step that takes another path (a unit skipped, a
different branch) stops prefetching for the rest of that run instead of gathering units that
will not run; its own order is what the following step prefetches from. At most one unit is
prefetched ahead of the one running ([Note: bounded prefetch]).

A backward knows more than the previous step: which units ran forward in this one. It follows its
previous run without the units that did not run forward in this step (``follow_forward``), so a
layer dropped from this step on is not gathered by its backward, while a GAN's two backwards, a
unit called twice or recomputed (activation checkpointing) keep the exact order they took. The
first backward of the first step, which has no previous run, follows the reverse of the order in
which units finished this step's forward (FSDP2's post-forward order). The forward can only predict
from the previous step: a unit skipped for the first time is gathered once in that step's forward
(``forward_prefetch=False`` avoids it).

[Note: bounded prefetch]
At most one unit is prefetched ahead of the one running, and at most one reduction is in
flight beyond the one just issued: besides the running unit, at most two units hold full
parameters (the root, while its forward is on the stack or its backward is due, and the
prefetched one).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

from fsdp_strategy.config import BackwardPrefetch


class Prefetch(NamedTuple):
    """Which all-gathers are issued ahead of their unit (FSDP1's ``forward_prefetch`` and
    ``backward_prefetch``). Costs of prefetching: one more unit's full parameters held at a time."""

    forward: bool = True  # in a unit's forward pre-hook, the next unit's (the previous step's order)
    backward: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE  # None: each unit gathers on arrival


class ExecutionOrder:
    """Per-phase records of unit order; ``record`` returns the unit to prefetch next, if any.

    Costs: a list append and two lookups per unit start.
    """

    def __init__(self) -> None:
        self._previous: dict[Hashable, list[Any]] = {}
        self._current: dict[Hashable, list[Any]] = {}
        self._following: dict[Hashable, bool] = {}

    def start(self, phase: Hashable) -> None:
        """Begin recording a run of ``phase``."""
        self._current[phase] = []
        self._following[phase] = True

    def record(self, phase: Hashable, unit: Any) -> Any | None:
        """Note that ``unit`` started in ``phase``; return the unit to prefetch now, or None."""
        current = self._current.get(phase)
        if current is None:
            return None
        index = len(current)
        current.append(unit)
        previous = self._previous.get(phase)
        if not self._following[phase] or previous is None or index >= len(previous) or previous[index] is not unit:
            self._following[phase] = False
            return None
        return previous[index + 1] if index + 1 < len(previous) else None

    def follow_forward(self, phase: Hashable, forward: Hashable, finished: list[Any] | None) -> None:
        """Let the backward ``phase`` just started prefetch from its previous run without the units
        that did not start in this step's run of the ``forward`` phase (in progress, or just ended);
        without a previous run, in the reverse of ``finished`` (the order units finished this step's
        forward), if given. Costs: one pass over both runs."""
        before = self._previous.get(phase)
        if before is not None:
            ran = set(self._current.get(forward, self._previous.get(forward, [])))  # units hash by identity
            self._previous[phase] = [unit for unit in before if unit in ran]
        elif finished is not None:
            self._previous[phase] = list(reversed(finished))

    def commit(self, phase: Hashable) -> None:
        """End the run of ``phase``: its order is what the next run prefetches from."""
        current = self._current.pop(phase, None)
        if current is not None:
            self._previous[phase] = current

    def discard(self) -> None:
        """Drop the runs in progress (a failed iteration); finished records stay."""
        self._current.clear()


def called_alike(unit: Any, target: Any) -> bool:
    """[Note: no prefetch across user code]
    A forward prefetch copies the target unit's shards when it is issued; a change made to them
    through ``.data`` before the target runs leaves no trace (``FSDPUnit._gather_is_stale`` sees
    version counters only), so the target would compute with the old values: a WGAN clipping its
    critic with ``p.data.clamp_`` in ``training_step``. So a unit prefetches the next one only where
    no user step code runs between their calls: both are called from the same module, not the root
    (whose forward runs ``training_step`` under Lightning), as the blocks of a model's layer list are.
    Not from the root to its first unit, nor from one model to another (a GAN's generator to its
    critic). Left: code that calls two units of one module itself and edits the second through
    ``.data`` between the calls. Costs: two attribute reads per prefetch."""
    return bool(unit.parent) and unit.parent == target.parent
