"""MemoryAccount: the engine's own count of the bytes it allocates while running.

Units report every allocation and release of the buffers they own beyond the shards at rest
(see [Note: what gathering allocates]); the account keeps the bytes alive now (in total and
per kind), the peak since the last ``reset_peak`` (one step, for the MemoryMonitor) and,
while ``recording``, a timeline of events for plots. Costs: a few integer operations per
event; the timeline only while recording.

[Note: what gathering allocates]
- "params": a unit's full parameters in ``param_dtype`` (padding included), from its gather
  until its reshard;
- "gather_buffer": the buffer a gather fills (this rank's row is the flat shard it sends), from
  the start of the gather until the copy-out into the full parameters;
- "reduce_buffer": the flat gradient rows a reduction sends plus the shard it receives (and, on
  gloo with more than 2 ranks, the slices received from all peers but one), from the
  start of the reduction until its result is added into the sharded gradients (the result
  itself becomes ``sharded.grad`` and is counted by ``Scheduler.sharded_bytes``);
- "stashed_grads": full-size gradients kept between micro-batches under ``no_sync``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

KINDS = ("params", "gather_buffer", "reduce_buffer", "stashed_grads")


class MemoryEvent(NamedTuple):
    """One change of the engine's live bytes."""

    seconds: float  # since recording started
    unit: str  # the unit that allocated or released
    event: str  # "gather"/"free" for full parameters, "alloc:<kind>"/"release:<kind>" for buffers
    bytes_now: int  # engine bytes alive after the event


@dataclass
class MemoryAccount:
    """Engine bytes alive beyond the shards: now (total and per kind), peak since reset, timeline."""

    current: int = 0
    peak: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    timeline: list[MemoryEvent] | None = None
    last_unit: str = ""  # the unit of the latest event (what a memory plan names at its peak)
    _t0: float = 0.0

    def allocated(self, unit: str, nbytes: int, kind: str = "params") -> None:
        """``unit`` allocated ``nbytes`` of ``kind`` (one of ``KINDS``)."""
        self.current += nbytes
        self.by_kind[kind] += nbytes
        self.peak = max(self.peak, self.current)
        self._note(unit, "gather" if kind == "params" else f"alloc:{kind}")

    def freed(self, unit: str, nbytes: int, kind: str = "params") -> None:
        """``unit`` released ``nbytes`` of ``kind``."""
        self.current -= nbytes
        self.by_kind[kind] -= nbytes
        self._note(unit, "free" if kind == "params" else f"release:{kind}")

    def reset_peak(self) -> None:
        """Start a new peak measurement from the bytes alive now."""
        self.peak = self.current

    def record(self) -> None:
        """Start (or restart) the timeline."""
        self.timeline = []
        self._t0 = time.perf_counter()

    def stop(self) -> list[MemoryEvent]:
        """Stop recording and return the timeline."""
        events, self.timeline = self.timeline or [], None
        return events

    def _note(self, unit: str, event: str) -> None:
        self.last_unit = unit
        if self.timeline is not None:
            self.timeline.append(MemoryEvent(time.perf_counter() - self._t0, unit, event, self.current))
