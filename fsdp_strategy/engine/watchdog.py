"""The watchdog: when a rank dies, raises, hangs or drifts, every rank stops and says where; a
rank that is alive and well is never ended for it.

[Note: watchdog]
A failure on one rank shows on the others as a collective that never ends (a dead peer on
NCCL, a peer stuck, or on another collective) or that ends in an error naming nothing of ours
("Connection closed by peer"). The watchdog turns each into a ``CollectiveError`` that names the
rank at fault and where every rank was ([Note: flight recorder]; reports.py assembles the message
from what the ranks published, with diagnosis.py's sentences):
- Side channel (channel.py): each rank publishes its identity (rank, node, host, pid) once, a
  heartbeat every ``HEARTBEAT`` seconds from a daemon thread, and, when it fails or raises, a
  report and the job's ``abort`` key (the first report wins).
- Limits: an engine collective may wait ``collective_timeout`` (default: the process group's
  timeout, which is Lightning's and torch's 30 minutes unless the strategy's ``timeout`` says
  otherwise). Blocking control-plane calls (barriers, broadcasts, Lightning's reduce, the
  checkpoint's object gathers) are left to the process group's own timeout: a rank-0 checkpoint
  write that outlives a short ``collective_timeout`` is not a failure.
- Waits: on gloo the host blocks, so waits poll (``work.wait(POLL)``) and raise within 0.2 s
  of another rank's report, of a peer this rank waits on having died (its process gone on this
  host, or on another host its heartbeat silent for ``SILENCE`` s), of an error of the wait, or
  of the wait outliving its limit. A collective issued after another rank's report raises at
  once, unless both ranks raised exceptions of their own (their ``on_exception`` runs together).
  On NCCL ``wait()`` only orders streams; the thread watches the oldest unfinished
  collective (and blocking calls) and reads the order stamps ([Note: order stamps]) once their
  event has passed; there it ends the process, since the host cannot be unblocked otherwise.
- Never ended for another's failure: a rank outside every collective when another rank reports
  only learns of it (it publishes where it is, for the failing rank's message) and goes on: its
  ``on_exception`` callbacks, ``finally`` blocks, uploads and own exceptions run to their end,
  and a caught exception leaves no deadline behind. Only a rank that then stays outside every
  collective for the whole ``collective_timeout`` is ended (a hung rank would hold the job
  forever otherwise).
- Ending: a rank whose collective failed cannot exit normally (gloo's threads and NCCL's
  kernels wait for the peer forever), so after a ``CollectiveError`` the process ends with
  ``os._exit(1)`` at interpreter exit (after the user's handlers), or ``collective_timeout``
  later if it is still running then.
Costs: one store write and one read per rank per ``HEARTBEAT`` in the thread; per collective
nothing beyond the recorder's append and two attribute reads; a Python loop only for waits
longer than ``POLL``.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from fsdp_strategy.engine.channel import StoreChannel, StoreLost
from fsdp_strategy.engine.device import DeviceLayer, HostCopy
from fsdp_strategy.engine.diagnosis import PeerLiveness, first_line
from fsdp_strategy.engine.flight import CollectiveRecord, FlightRecorder
from fsdp_strategy.engine.reports import Reports
from fsdp_strategy.engine.watch_limits import (
    HEARTBEAT,
    ORPHAN_GRACE,
    PEER_CHECK_AFTER,
    POLL,
    SILENCE,
    Limits,
    flush_and_exit,
    limits_for,
)

log = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """A collective failed, outlived ``collective_timeout``, or the ranks issued different ones.

    The message names the rank at fault and where every rank was ([Note: watchdog]).
    """


class Watchdog:
    """Heartbeats, reports and timed waits for the default process group ([Note: watchdog])."""

    def __init__(
        self,
        channel: StoreChannel,
        rank: int,
        world: int,
        node: int,
        limits: Limits,
        recorder: FlightRecorder,
        dump_dir: str = ".",
    ) -> None:
        self.rank, self.world, self.node = rank, world, node
        self.limits = limits
        self.recorder = recorder
        self.identity = {"rank": rank, "node": node, "host": socket.gethostname(), "pid": os.getpid()}
        self._launcher = os.getppid()  # the process that started this rank (Lightning's launcher: rank 0)
        # fields the main thread and the watchdog's thread both write are set under this lock (reads
        # of one field are atomic; what is decided from two of them is decided under it)
        self._lock = threading.Lock()
        self.error: CollectiveError | None = None  # this rank's failure; every later collective raises it again
        self.abort: str | None = None  # another rank's first report, seen by the thread
        self._abort_raised = False  # ... was an exception that rank raised (not a failed collective)
        self.peer_lost: str | None = None  # a rank this one waits on has died, seen by the thread
        self.reported_own = False  # this rank published an exception of its own
        self._channel = channel
        self.reports = Reports(channel, self.identity, world, recorder, dump_dir)
        self._beats = 0
        self._liveness = PeerLiveness(self.identity["host"], SILENCE, PEER_CHECK_AFTER)
        self._end_at: float | None = None  # monotonic deadline after which this process is ended
        self._end_reason = ""  # what went wrong (a CollectiveError, another rank's report)
        self._end_why = ""  # why the deadline came: what this rank did not do in time
        self._outside_published = False
        self._watched: deque[CollectiveRecord] = deque()  # NCCL / blocking records the thread watches
        self._unverified: deque[tuple[CollectiveRecord, HostCopy]] = deque()  # CUDA stamp checks
        self._stop = threading.Event()
        self._previous_excepthook = sys.excepthook
        self._closed = False
        try:
            channel.set(f"peer/{rank}", json.dumps(self.identity))
        except StoreLost:
            log.warning("fsdp_custom watchdog: the store does not answer; failures will be reported without peers")
        self._thread = threading.Thread(target=self._run, name="fsdp-custom-watchdog", daemon=True)
        self._thread.start()

    # ---- the main thread's side --------------------------------------------------------

    def check_issue(self, record: CollectiveRecord) -> None:
        """Raise before ``record`` is issued if this job was stopped: by this rank's own failure,
        another rank's report, or the death of a rank."""
        if self.error is not None:
            raise self.error
        reason = self._stopped_by()
        if reason is not None:
            self.fail(record, reason)

    def wait(self, work: Any, record: CollectiveRecord, host_blocking: bool) -> None:
        """Wait for ``work``: polling on the host (gloo), or order the stream and watch it (NCCL)."""
        if self.error is not None:
            raise self.error
        record.limit = self.limits.collective
        if not host_blocking:
            work.wait()
            record.work = work
            self._watched.append(record)
            return
        self.recorder.waiting = record
        try:
            while True:
                try:
                    work.wait(POLL)
                    break
                except RuntimeError as error:
                    if "timed out" not in str(error):
                        self.fail(record, f"its wait failed: {first_line(error)}", error)
                    reason = self._stopped_by() or self._over_limit(record)
                    if reason is not None:
                        self.fail(record, reason)
        finally:
            self.recorder.waiting = None
        record.ended = time.time()

    def watch_blocking(self, record: CollectiveRecord) -> None:
        """Let the thread time a blocking call the main thread cannot poll (a barrier)."""
        if self.error is not None:
            raise self.error
        record.limit = self.limits.control
        self._watched.append(record)

    def defer_check(self, record: CollectiveRecord, mismatch: torch.Tensor) -> None:
        """Check a CUDA stamp comparison when the device has computed it, without a sync."""
        self._unverified.append((record, DeviceLayer.copy_to_host(mismatch)))

    def report_exception(self, error: BaseException) -> None:
        """Publish this rank's own exception: the other ranks' collectives then raise, naming it."""
        with self._lock:
            if self.error is not None or isinstance(error, CollectiveError) or self.reported_own:
                return
            self.reported_own = True
            self._end_at = None  # alive and unwinding: no deadline from another rank's report stays
        self.reports.publish_raised(error)

    def fail(self, record: CollectiveRecord | None, reason: str, cause: BaseException | None = None) -> NoReturn:
        """Publish, diagnose, and raise the ``CollectiveError`` of this rank's failure."""
        if self.error is None:
            message = self.reports.message(record, reason)  # outside the lock: it may read the store
            with self._lock:
                if self.error is None:  # the other thread may have failed meanwhile: its error stands
                    self.error = CollectiveError(message)
                    seconds = self.limits.collective
                    self._end_after(self.error, seconds, f"it was still running {seconds:g} s after this error")
        raise self.error from cause

    def _stopped_by(self) -> str | None:
        """Another rank's report, unless both raised exceptions of their own (their ``on_exception``
        work, ``save_on_exception``'s collectives, goes on together); a peer that died."""
        if self.abort is not None and not (self.reported_own and self._abort_raised):
            return "another rank stopped the job"
        return self.peer_lost

    @staticmethod
    def _over_limit(record: CollectiveRecord) -> str | None:
        over = record.limit is not None and record.waited() > record.limit
        return f"it waited {record.waited():.1f} s (collective_timeout={record.limit:g} s)" if over else None

    def _end_after(self, reason: Any, seconds: float, why: str) -> None:
        """Set the deadline to end this process for ``reason`` in ``seconds``; ``why`` says what
        missing it means (the caller holds ``_lock``)."""
        if math.isfinite(seconds) and self._end_at is None:
            self._end_at = time.monotonic() + seconds
            self._end_reason, self._end_why = str(reason), why

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as error:  # never let the thread die with a trace; the next tick retries
                log.debug("fsdp_custom watchdog: %s", first_line(error))
            known = len(self.reports.identities) == self.world or self._channel.lost is not None
            if self._stop.wait(HEARTBEAT if known else 0.05):
                return

    def _tick(self) -> None:
        if self._end_at is not None and time.monotonic() > self._end_at:  # first: the store may be gone
            self._end(self._end_reason, self._end_why)
        self._end_sooner_if_orphaned(os.getppid())
        self.reports.check_store_host()
        if self._channel.lost is None:
            try:
                self.reports.learn_identities()
                self._beats += 1
                self._channel.set(f"beat/{self.rank}", str(self._beats))
                if self.abort is None:
                    self._read_abort()
            except StoreLost as error:  # not a failure by itself: ranks end at different times
                log.debug("fsdp_custom watchdog: the store is gone, no more heartbeats: %s", error)
        self._check_device()
        self._check_peers()
        self._check_watched()
        if self.abort is not None and self.error is None:
            self._outside_collective()

    def _end_sooner_if_orphaned(self, parent: int) -> None:
        """A rank due to end whose launcher has exited (``parent`` is no longer the process that
        started it: the job is over) ends ``ORPHAN_GRACE`` s later, if that is sooner."""
        with self._lock:
            if self._end_at is None or parent == self._launcher:
                return
            self._launcher = parent
            soon = time.monotonic() + ORPHAN_GRACE
            if soon < self._end_at:
                self._end_at = soon
                self._end_why = f"the process that started this rank exited {ORPHAN_GRACE:g} s before"

    def _read_abort(self) -> None:
        text = self._channel.read("abort")
        if text:
            first = json.loads(text)
            if first["rank"] != self.rank:
                with self._lock:
                    self.abort = self.reports.abort_seen = first["reason"]
                    self._abort_raised = first.get("kind") == "raised"

    def _check_device(self) -> None:
        while self._unverified and self._unverified[0][1].landed():
            record, copy = self._unverified.popleft()
            if bool(copy.value) and self.error is None:
                self._fail_from_thread(record, "the ranks issued different collectives here (order stamps differ)")

    def _check_peers(self) -> None:
        """While this rank waits long, notice a peer that died (``PeerLiveness`` decides)."""
        oldest = self.recorder.waiting or (self._watched[0] if self._watched else None)
        if oldest is None or oldest.waited() < PEER_CHECK_AFTER or self.peer_lost is not None:
            self._liveness.forget()
            return
        gone, beats, now = self.reports.gone_locally(), {}, time.monotonic()
        known = len(self.reports.identities) == self.world and self._channel.lost is None
        if not gone and known and self._liveness.due(now):
            try:
                beats = self._channel.read_ranks("beat", self.world)
            except StoreLost:
                return
        hosts = {rank: identity["host"] for rank, identity in self.reports.identities.items()}
        lost = self._liveness.lost(gone, beats, hosts, now)
        if lost is not None:
            with self._lock:
                self.peer_lost = lost

    def _check_watched(self) -> None:
        while self._watched and (self._watched[0].ended is not None or self._watched[0].poll_completed()):
            self._watched.popleft()
        if not self._watched or self.error is not None:
            return
        oldest = self._watched[0]
        # a blocking call on gloo fails by itself once a dead peer's connection closes, and then
        # raises in the main thread (its handlers run); only a device-side collective (NCCL), which
        # nothing on the host will ever fail, is ended from here on another rank's report
        stopped = self._stopped_by() if oldest.work is not None else None
        reason = stopped or self._over_limit(oldest)
        if reason is not None:
            self._fail_from_thread(oldest, reason)

    def _fail_from_thread(self, record: CollectiveRecord, reason: str) -> None:
        """A collective the host cannot be woken from failed: diagnose and end the process."""
        try:
            self.fail(record, reason)
        except CollectiveError as error:
            self._end(error)

    def _outside_collective(self) -> None:
        """Another rank reported while this one is outside every collective: say where this rank
        is (for that rank's message) and go on; end only after ``collective_timeout`` outside."""
        if self._outside_published or self.reported_own or self.recorder.waiting is not None:
            return
        self._outside_published = True
        limit = self.limits.collective
        self.reports.publish_outside(self.abort, limit)
        with self._lock:  # unless this rank raised meanwhile: alive and unwinding, it is not ended
            if not self.reported_own and self.error is None:
                self._end_after(self.abort, limit, f"this rank issued no collective for {limit:g} s after it")

    # ---- life ---------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        collective_timeout: float | None = None,
        node: int | None = None,
        report_uncaught: bool = True,
        dump_dir: str | os.PathLike | None = None,
    ) -> Watchdog | None:
        """Start a watchdog of the default process group (None without a group of two ranks or
        more). Every rank starts it at the same point; the caller owns it and ``close``s it.
        ``collective_timeout``: None for the group's own timeout. ``report_uncaught``: publish an
        uncaught exception of this process (``sys.excepthook``, until ``close``). ``dump_dir``:
        where a rank whose collective failed writes its flight recorder ring (default: the working
        folder; one file per rank)."""
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        count = store.add(f"fsdp_custom/watchdog/starts/{rank}", 1)  # the k-th start of every rank: k
        # under torchrun the store is the agent's, kept across restarts: the group's keys are this attempt's
        # ([Note: one namespace per attempt] in fsdp_strategy/distributed/rendezvous.py)
        channel = StoreChannel.connect(store, f"fsdp_custom/watchdog/{count}/")
        if node is None:
            node = int(os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or 0)
        limits, folder = limits_for(collective_timeout), os.fspath(dump_dir or os.getcwd())
        dog = cls(channel, rank, dist.get_world_size(), node, limits, FlightRecorder(), folder)
        if report_uncaught:
            dog._previous_excepthook, sys.excepthook = sys.excepthook, dog._report_uncaught
        atexit.register(dog._at_exit)
        return dog

    def close(self) -> None:
        """Remove what ``start`` installed and stop the thread. After a failure of this rank the
        thread and the exit hook stay: they end the wedged process ``collective_timeout`` later or
        at interpreter exit ([Note: watchdog])."""
        self._closed = True  # an exception hook still chained through this one passes through
        if sys.excepthook == self._report_uncaught:
            sys.excepthook = self._previous_excepthook
        if self.error is not None:
            return
        self.stop()
        self._thread.join(timeout=10.0)
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        """End a wedged process at once; otherwise stop the thread before the interpreter tears down
        what its store calls use (a thread left running can abort the exit in C++)."""
        if self.error is not None:
            flush_and_exit()
        self.stop()
        self._thread.join(timeout=10.0)

    def _report_uncaught(self, kind: type, error: BaseException, traceback: Any) -> None:
        if not self._closed:
            self.report_exception(error)
        self._previous_excepthook(kind, error, traceback)

    @staticmethod
    def _end(reason: str, why: str) -> NoReturn:
        reason = reason.removeprefix("fsdp_custom: ")
        sys.stderr.write(f"fsdp_custom: ending this process ({why}): {reason}\n")
        flush_and_exit()

    def stop(self) -> None:
        """Stop the thread (the process group is going away, or a new run starts); a store call in
        flight ends within its timeout and is not retried."""
        self._stop.set()
        self._channel.close()
