"""The communication ledger: calls, bytes and times of the engine's collectives, per kind and unit.

Costs: a dict update per collective; nothing is synchronized.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum


class CollectiveKind(str, Enum):
    """The collectives the engine issues."""

    ALL_GATHER = "all_gather"  # gather a unit's shards before it runs
    REDUCE_SCATTER = "reduce_scatter"  # reduce a unit's gradients into shards
    ALL_REDUCE = "all_reduce"  # replicas' gradients (NO_SHARD / HYBRID_SHARD), clipping norms
    ALL_TO_ALL = "all_to_all"  # whole matrices to and from their owners (whole-matrix optimizers)


@dataclass
class KindTotals:
    """Calls and bytes of one collective kind."""

    calls: int = 0
    payload_bytes: int = 0  # size of the full (gathered / to-be-scattered / reduced) buffer
    wire_bytes: int = 0  # bytes each rank sends with a ring algorithm: payload x (N-1)/N (x2 all-reduce)
    busy_seconds: float = 0.0  # from issue until its wait() returned: an upper bound of the transfer time
    exposed_seconds: float = 0.0  # time the caller was blocked in wait(): communication not hidden

    def add(self, payload: int, wire: int) -> None:
        """Count one call of ``payload`` bytes, ``wire`` of them sent."""
        self.calls += 1
        self.payload_bytes += payload
        self.wire_bytes += wire


@dataclass
class CommLedger:
    """Counts collective calls and bytes per kind (and per unit) since the last ``start_step``.

    Costs: a dict update per collective; nothing is synchronized.
    """

    current: dict[str, KindTotals] = field(default_factory=lambda: defaultdict(KindTotals))
    per_unit: dict[str, dict[str, KindTotals]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(KindTotals))
    )
    last_step: dict[str, KindTotals] = field(default_factory=dict)
    last_step_per_unit: dict[str, dict[str, KindTotals]] = field(default_factory=dict)
    copied: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # bytes per copy kind, this step
    last_step_copied: dict[str, int] = field(default_factory=dict)
    # tensor parallel's own collectives (DTensor's), apart from the engine's: tensor_parallel_count.py
    tensor_parallel: dict[str, KindTotals] = field(default_factory=lambda: defaultdict(KindTotals))
    last_step_tensor_parallel: dict[str, KindTotals] = field(default_factory=dict)

    def record(self, kind: CollectiveKind, unit: str, payload: int, wire: int) -> None:
        """Count one call of ``kind`` for ``unit``."""
        self.current[kind.value].add(payload, wire)
        self.per_unit[unit][kind.value].add(payload, wire)

    def record_wait(self, kind: CollectiveKind, unit: str, busy: float, exposed: float) -> None:
        """Add the times of one finished call (see ``KindTotals``)."""
        for totals in (self.current[kind.value], self.per_unit[unit][kind.value]):
            totals.busy_seconds += busy
            totals.exposed_seconds += exposed

    def record_copy(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` the engine copied outside collectives: ``gather_copy_in`` (shards into a
        gather buffer), ``gather_copy_out`` (into full parameters), ``reduce_copy_in`` (full
        gradients into a reduce buffer)."""
        self.copied[kind] += nbytes

    def record_tensor_parallel(self, kind: str, payload: int, wire: int) -> None:
        """Count one of tensor parallel's own collectives (issued by DTensor, not by the engine), of
        ``kind`` (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``)."""
        self.tensor_parallel[kind].add(payload, wire)

    def start_step(self) -> None:
        """Move the running counts to ``last_step`` and start counting from zero."""
        self.last_step = dict(self.current)
        self.last_step_per_unit = {unit: dict(kinds) for unit, kinds in self.per_unit.items()}
        self.last_step_copied = dict(self.copied)
        self.last_step_tensor_parallel = dict(self.tensor_parallel)
        self.current = defaultdict(KindTotals)
        self.per_unit = defaultdict(lambda: defaultdict(KindTotals))
        self.copied = defaultdict(int)
        self.tensor_parallel = defaultdict(KindTotals)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """The running counts as plain dicts: ``{kind: {"calls", "payload_bytes", "wire_bytes"}}``."""
        return {kind: vars(totals).copy() for kind, totals in self.current.items()}
