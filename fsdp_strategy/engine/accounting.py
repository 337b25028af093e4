"""MemoryAccount: the engine's own count of gathered (unsharded) parameter bytes.

Units report every allocation and release of full parameters; the account keeps the bytes
alive now, the peak since the last ``reset_peak`` (one step, for the MemoryMonitor), the peak
per unit, and, while ``recording``, a timeline of events for plots. Costs: a few integer
operations per gather and reshard; the timeline only while recording.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple


class MemoryEvent(NamedTuple):
    """One change of gathered bytes."""

    seconds: float  # since recording started
    unit: str  # the unit that gathered or freed
    event: str  # "gather" or "free"
    bytes_now: int  # gathered bytes alive after the event


@dataclass
class MemoryAccount:
    """Gathered parameter bytes: now, peak since reset, per unit, and an optional timeline."""

    current: int = 0
    peak: int = 0
    per_unit: dict[str, int] = field(default_factory=dict)
    timeline: list[MemoryEvent] | None = None
    _t0: float = 0.0

    def allocated(self, unit: str, nbytes: int) -> None:
        """``unit`` gathered ``nbytes`` of full parameters."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self.per_unit[unit] = nbytes
        self._note(unit, "gather")

    def freed(self, unit: str, nbytes: int) -> None:
        """``unit`` released ``nbytes`` of full parameters."""
        self.current -= nbytes
        self._note(unit, "free")

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
        if self.timeline is not None:
            self.timeline.append(MemoryEvent(time.perf_counter() - self._t0, unit, event, self.current))
