"""CollectiveMonitor: what the engine watches about its collectives, in one object they report to.

The collectives (collectives.py) only move bytes, and define the interface they report to
(``CollectiveObserver``), which this module implements. Each one they issue is reported here first
(``issue``) and waited for through here (``Watch.wait``), and this object keeps, for one engine
instance: the communication ledger (calls, bytes, times: ledger.py), the flight recorder of
this process's last collectives ([Note: flight recorder] in flight.py), the order stamps that
check every rank issued the same collective ([Note: order stamps]), and the watchdog that stops
every rank when one fails ([Note: watchdog] in watchdog.py). A context without an observer moves
the same bytes and watches nothing. Costs per collective: a ledger entry, a flight record, and
with stamps 16 elements per rank and one comparison after the wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from fsdp_strategy.engine.flight import STAMP_SLOTS, CollectiveRecord, FlightRecorder, Stamp, stamp_exact
from fsdp_strategy.engine.ledger import CollectiveKind, CommLedger
from fsdp_strategy.engine.trace import span
from fsdp_strategy.engine.watchdog import CollectiveError, Watchdog


class Watch:
    """One issued collective as the observer follows it: its flight record and, when stamped, the
    check of its stamps after the wait."""

    def __init__(
        self,
        observer: CollectiveMonitor,
        kind: CollectiveKind,
        unit: str,
        record: CollectiveRecord,
        host_blocking: bool,
    ) -> None:
        self.observer, self.kind, self.unit, self.record = observer, kind, unit, record
        self.host_blocking = host_blocking
        self.check: Callable[[CollectiveRecord], None] | None = None
        self.issued = time.perf_counter()

    def stamp_rows(self, shard: torch.Tensor, output: torch.Tensor, size: int, group: Any) -> None:
        """All-gather: write the stamp into the last ``STAMP_SLOTS`` elements of ``shard``; after
        the wait, every rank's row of ``output`` must hold it."""
        stamp = self.observer.stamp(self.kind, self.unit).tensor(shard.dtype, shard.device)
        shard[-STAMP_SLOTS:].copy_(stamp)
        slots = output.view(size, -1)[:, -STAMP_SLOTS:]
        self.check = self.observer.stamp_check(slots, stamp.expand(size, -1), group, per_rank=True)

    def stamp_sum(self, sent: torch.Tensor, summed: torch.Tensor, size: int, group: Any) -> None:
        """A SUM: write the stamp into ``sent`` (the slots of every row the sum reads); after the wait
        ``summed`` must hold ``size`` times it, where such a sum of bits is exact in the dtype."""
        stamp = self.observer.stamp(self.kind, self.unit)
        sent.copy_(stamp.tensor(sent.dtype, sent.device))
        if stamp_exact(sent.dtype, size):
            expected = stamp.tensor(sent.dtype, sent.device, size)
            self.check = self.observer.stamp_check(summed, expected, group, per_rank=False)

    def wait(self, work: Any) -> None:
        """Wait for ``work`` under the watchdog (if any), check the stamps, time it in the ledger."""
        start = time.perf_counter()
        with span("wait_" + self.kind.value):
            dog = self.observer.watchdog
            if dog is None:
                work.wait()
                self.record.ended = time.time()
            else:
                dog.wait(work, self.record, self.host_blocking)
        end = time.perf_counter()
        if self.check is not None:
            self.check(self.record)
        self.observer.ledger.record_wait(self.kind, self.unit, end - self.issued, end - start)


class CollectiveMonitor:
    """The ledger, flight recorder, order stamps and watchdog of one engine instance's collectives.

    ``recorder`` is the watchdog's when one is given, so a process has one sequence of records.
    Owned by the Scheduler (through its ``CommContext``)."""

    def __init__(self, ledger: CommLedger | None = None, watchdog: Watchdog | None = None) -> None:
        self.ledger = ledger or CommLedger()
        self.watchdog = watchdog
        self.recorder = watchdog.recorder if watchdog is not None else FlightRecorder()
        self._stamps: dict[tuple[str, str], Stamp] = {}

    def issue(
        self, kind: CollectiveKind, unit: str, dtype: torch.dtype, payload: int, wire: int, host_blocking: bool
    ) -> Watch:
        """Count and record a collective about to be issued; raise if the job was stopped."""
        self.ledger.record(kind, unit, payload, wire)
        record = self.recorder.issue(kind.value, unit, dtype, payload)
        if self.watchdog is not None:
            self.watchdog.check_issue(record)
        return Watch(self, kind, unit, record, host_blocking)

    def record_copy(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` copied outside collectives in the ledger."""
        self.ledger.record_copy(kind, nbytes)

    def stamp(self, kind: CollectiveKind, unit: str) -> Stamp:
        """The order stamp of (kind, unit) ([Note: order stamps])."""
        key = (kind.value, unit)
        if key not in self._stamps:
            self._stamps[key] = Stamp(kind.value, unit)
        return self._stamps[key]

    def stamp_check(self, slots: torch.Tensor, expected: torch.Tensor, group: Any, per_rank: bool) -> Callable:
        """The check run after the wait: ``slots`` (after the collective) must equal ``expected``."""

        def check(record: CollectiveRecord) -> None:
            if isinstance(slots, FakeTensor):  # a memory plan's collectives carry no values ([Note: memory plan])
                return
            if slots.is_cuda:
                if self.watchdog is not None:
                    self.watchdog.defer_check(record, (slots != expected).any())
                return
            if torch.equal(slots, expected):
                return
            reason = "the ranks issued different collectives here (order stamps differ)"
            if per_rank:
                rows = range(slots.shape[0])
                others = [_global_rank(group, row) for row in rows if not torch.equal(slots[row], expected[row])]
                reason = f"ranks {others} issued a different collective here (their order stamps differ)"
            if self.watchdog is None:
                raise CollectiveError(f"fsdp_custom: {record.describe()}: {reason}")
            self.watchdog.fail(record, reason)

        return check

    def attach(self, watchdog: Watchdog | None) -> None:
        """Let ``watchdog`` (a new run's) watch these collectives, recording into its ring; None:
        unwatched (a closed watchdog's heartbeat has stopped), recording into a ring of its own."""
        self.watchdog = watchdog
        self.recorder = watchdog.recorder if watchdog is not None else FlightRecorder()

    def at_step(self, step: int) -> None:
        """Name the records that follow by the trainer's global ``step`` ([Note: flight recorder])."""
        self.recorder.step = step

    def wedged(self) -> bool:
        """Whether a collective failed ([Note: watchdog]): none can be waited for."""
        return self.watchdog is not None and self.watchdog.error is not None

    def close(self) -> None:
        """Forget the stamps computed for this instance's units."""
        self._stamps.clear()


def _global_rank(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


@contextmanager
def watched(kind: str, name: str, dog: Watchdog | None) -> Iterator[None]:
    """Run a blocking call of the default group (a barrier, a broadcast) under the watchdog ``dog``
    (if any): it is recorded ([Note: flight recorder]), timed by the thread, and a failure of it
    becomes a ``CollectiveError`` naming where every rank was. Costs: one record."""
    if dog is None or threading.current_thread() is not threading.main_thread():  # a background save
        yield
        return
    record = dog.recorder.issue(kind, name)
    dog.check_issue(record)
    dog.watch_blocking(record)
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        dog.fail(record, f"it failed: {type(error).__name__}: {str(error).strip()[:300]}", error)
    finally:
        record.ended = time.time()
