"""The watchdog: when a rank dies, raises, hangs or drifts, every rank stops fast and says where.

[Note: watchdog]
A failure on one rank shows on the others as a collective that never ends (a dead peer on
NCCL, a peer stuck, or on another collective) or that ends in an error naming nothing of ours
("Connection closed by peer"). The watchdog turns each into a ``CollectiveError`` that names the
rank at fault and where every rank was ([Note: flight recorder]):
- Side channel: the default process group's own store, through a second client connection
  (``store.clone()``; its calls time out after ``STORE_TIMEOUT``). Each rank publishes its
  identity (rank, node, host, pid) once, a heartbeat counter every ``interval`` seconds from a
  daemon thread, and, when it fails, a report (its reason and its ring) and the job's ``abort``
  key (the first reason wins).
- Waits: on gloo the host blocks, so waits poll (``work.wait(POLL)``) and notice within 0.2 s a
  failure another rank published, an error of the wait, or a wait older than
  ``collective_timeout``. On NCCL ``wait()`` only orders streams; the thread then watches the
  oldest unfinished collective, and reads the order stamps ([Note: order stamps]) once their
  event has passed. Blocking calls (barriers, broadcasts) are watched by the thread too.
- Diagnosis: the failing rank reports, logs a first line at once (a launcher may kill it next),
  waits up to ``grace`` seconds for the other ranks' reports (a rank whose process is gone on
  this host, or whose heartbeat stopped, is lost), and raises a message with one line per rank:
  lost, raised, behind, ahead, or on another collective.
- Ending: a rank whose collectives are wedged cannot exit normally (gloo's threads and NCCL's
  kernels wait for the peer forever), so after a ``CollectiveError`` the process ends with
  ``os._exit(1)`` at interpreter exit, or ``EXIT_GRACE`` seconds later if it is still running.
  A rank that sees another's report while it is outside any collective (stuck in Python) logs
  it and ends the same way.
Costs: one store write per rank per ``interval`` in the thread; per collective nothing beyond
the recorder's append, and a Python loop only for waits longer than ``POLL``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from fsdp_strategy.engine.flight import RECORDER, CollectiveRecord

log = logging.getLogger(__name__)

POLL = timedelta(seconds=0.2)
STORE_TIMEOUT = timedelta(seconds=5)
EXIT_GRACE = 10.0  # seconds a failed process may take to print and unwind before os._exit
DEFAULT_COLLECTIVE_TIMEOUT = 600.0  # seconds; NCCL's default, a third of Lightning's 30 minutes


class CollectiveError(RuntimeError):
    """A collective failed, outlived ``collective_timeout``, or the ranks issued different ones.

    The message names the rank at fault and where every rank was ([Note: watchdog]).
    """


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


class Watchdog:
    """Heartbeats, reports and timed waits for one process group ([Note: watchdog])."""

    def __init__(self, store: Any, rank: int, world: int, node: int, collective_timeout: float | None) -> None:
        self.rank, self.world, self.node = rank, world, node
        self.collective_timeout = collective_timeout
        self.interval = 1.0
        self.grace = 5.0
        self.identity = {"rank": rank, "node": node, "host": socket.gethostname(), "pid": os.getpid()}
        self.error: CollectiveError | None = None  # raised once; every later wait raises it again
        self.abort_reason: str | None = None  # another rank's published failure, seen by the thread
        self.reported_own = False  # this rank published an exception of its own step
        self._store = store
        self.dump_path = ""  # this rank's ring, written when it reports
        self._identities: dict[int, dict[str, Any]] = {}  # filled by the thread until every rank is known
        self._beats = 0
        self._store_lost = False  # a store call failed: the thread no longer calls it
        self._exit_at: float | None = None
        self._watched: deque[CollectiveRecord] = deque()  # NCCL / blocking records the thread watches
        self._unverified: deque[tuple[CollectiveRecord, torch.Tensor, Any]] = deque()  # CUDA stamp checks
        self._stop = threading.Event()
        store.set(f"peer/{rank}", json.dumps(self.identity))
        self._thread = threading.Thread(target=self._run, name="fsdp-custom-watchdog", daemon=True)
        self._thread.start()

    # ---- the main thread's side --------------------------------------------------------

    def wait(self, work: Any, record: CollectiveRecord, host_blocking: bool) -> None:
        """Wait for ``work``: polling on the host (gloo), or order the stream and watch it (NCCL)."""
        if self.error is not None:
            raise self.error
        if not host_blocking:
            work.wait()
            record.work = work
            self._watched.append(record)
            return
        RECORDER.waiting = record
        try:
            while True:
                try:
                    work.wait(POLL)
                    break
                except RuntimeError as error:
                    if "timed out" not in str(error):
                        self.fail(record, f"its wait failed: {_first_line(error)}", error)
                    if self.abort_reason is not None:
                        self.fail(record, "another rank stopped the job")
                    if self._timed_out(record):
                        self.fail(record, self._timeout_reason(record))
        finally:
            RECORDER.waiting = None
        record.ended = time.time()

    def watch_blocking(self, record: CollectiveRecord) -> None:
        """Let the thread time a blocking call the main thread cannot poll (a barrier)."""
        self._watched.append(record)

    def defer_check(self, record: CollectiveRecord, mismatch: torch.Tensor) -> None:
        """Check a CUDA stamp comparison when the device has computed it, without a sync."""
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(mismatch, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._unverified.append((record, host, event))

    def report_exception(self, error: BaseException) -> None:
        """Publish this rank's own exception, so waiting ranks stop and name it."""
        if self.error is not None or isinstance(error, CollectiveError) or self.reported_own:
            return
        self.reported_own = True
        self._publish(f"rank {self.rank} raised {_first_line(error)}", None, "raised")

    def fail(self, record: CollectiveRecord | None, reason: str, cause: BaseException | None = None) -> NoReturn:
        """Publish, diagnose, and raise the ``CollectiveError`` of this rank's failure."""
        if self.error is None:
            self._exit_at = time.time() + self.grace + EXIT_GRACE  # the diagnosis may wait ``grace``
            self.error = CollectiveError(self._diagnose(record, reason))
        raise self.error from cause

    # ---- diagnosis ---------------------------------------------------------------------

    def _publish(self, reason: str, record: CollectiveRecord | None, kind: str = "failed") -> None:
        """Write this rank's report (``kind``: "failed", "raised" or "outside") and the abort key."""
        report = {**self.identity, "reason": reason, "kind": kind, "waiting": record is not None}
        latest = record or RECORDER.latest()
        report["latest"] = latest.as_dict() if latest is not None else None
        path = os.path.join(tempfile.gettempdir(), f"fsdp_custom_flight_rank{self.rank}_pid{os.getpid()}.json")
        try:
            with open(path, "w") as file:
                json.dump({**report, "ring": RECORDER.snapshot()}, file, indent=1)
        except OSError:
            path = "(not written)"
        report["dump"] = self.dump_path = path
        try:
            self._store.set(f"report/{self.rank}", json.dumps(report))
            self._store.compare_set("abort", "", reason)
        except Exception as error:  # the store's host is gone: the report stays local
            log.debug("fsdp_custom watchdog: cannot publish: %s", error)

    def _diagnose(self, record: CollectiveRecord | None, reason: str) -> str:
        where = record.describe() if record is not None else "no collective"
        headline = f"fsdp_custom: rank {self.rank} (node {self.node}) stopped at {where}: {reason}"
        self._publish(headline, record)
        try:
            first = self._store.get("abort").decode()
        except Exception:
            first = self.abort_reason or headline
        gone = "".join(f"; rank {r} has exited" for r in sorted(self._gone_locally()))
        earlier = f"; first report: {first}" if first != headline else ""
        log.error("%s%s%s", headline, earlier, gone)  # at once: a launcher may kill this rank next
        lines = [headline] + ([f"First report: {first}"] if first != headline else [])
        lines += self._peer_lines(record)
        every = os.path.join(tempfile.gettempdir(), "fsdp_custom_flight_rank*.json")
        lines.append(f"Flight recorder rings: {every} (this rank: {self.dump_path})")
        return "\n  ".join(lines)

    def _read(self, prefix: str) -> dict[int, Any]:
        keys = [f"{prefix}/{rank}" for rank in range(self.world)]
        found = {}
        for rank, key in enumerate(keys):
            if self._store.check([key]):
                found[rank] = self._store.get(key).decode()
        return found

    def _peer_lines(self, record: CollectiveRecord | None) -> list[str]:
        """One line per other rank, after waiting up to ``grace`` seconds for their reports."""
        identities = self._identities
        try:
            self._learn_identities()
            beats_before = self._read("beat")
            deadline = time.time() + self.grace
            while True:
                reports = {rank: json.loads(text) for rank, text in self._read("report").items()}
                gone = self._gone_locally()
                missing = [r for r in range(self.world) if r != self.rank and r not in reports and r not in gone]
                if not missing or time.time() > deadline:
                    break
                time.sleep(0.1)
            beats_after = self._read("beat")
        except Exception as error:
            lost = "".join(f"; rank {r} LOST, its process has exited" for r in sorted(self._gone_locally()))
            return [
                f"the store is unreachable ({_first_line(error)}): the process that hosts it (global rank 0 under "
                f"Lightning's launcher or env://, the torchrun agent of node 0 under torchrun) has ended{lost}"
            ]
        mine = record or RECORDER.latest()
        lines = []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            who = identities.get(rank, {"node": "?", "host": "?", "pid": "?"})
            name = f"rank {rank} (node {who['node']}, host {who['host']}, pid {who['pid']})"
            if rank in reports:
                lines.append(f"{name}: {self._relation(reports[rank], mine)}")
            elif rank in gone:
                lines.append(f"{name}: LOST, its process has exited (killed, or out of memory?)")
            elif beats_before.get(rank) == beats_after.get(rank):
                lines.append(f"{name}: LOST, no heartbeat for {self.grace:.0f} s and no report")
            else:
                lines.append(f"{name}: alive but sent no report")
        return lines

    def _gone_locally(self) -> set[int]:
        """Ranks on this host whose process has exited."""
        host = self.identity["host"]
        return {r for r, who in self._identities.items() if who["host"] == host and _process_gone(who["pid"])}

    def _timed_out(self, record: CollectiveRecord) -> bool:
        return self.collective_timeout is not None and time.time() - record.issued > self.collective_timeout

    def _timeout_reason(self, record: CollectiveRecord) -> str:
        waited = time.time() - record.issued
        return f"it waited {waited:.1f} s (collective_timeout={self.collective_timeout:g} s)"

    @staticmethod
    def _relation(report: dict[str, Any], mine: CollectiveRecord | None) -> str:
        latest = report.get("latest")
        if latest is None:
            return f"has issued no collective; {report['reason']}"
        other = CollectiveRecord(**latest)
        state = "waiting for" if report.get("waiting") else "last issued"
        text = f"{state} {other.describe()}"
        if mine is not None:
            if other.seq < mine.seq:
                text += f", BEHIND by {mine.seq - other.seq}"
            elif other.seq > mine.seq:
                text += f", ahead by {other.seq - mine.seq}"
            elif (other.kind, other.unit) != (mine.kind, mine.unit):
                text += ", a DIFFERENT collective at the same place"
        if report.get("kind") in ("raised", "outside"):
            text += f"; {report['reason']}"
        return text

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._tick()
            except Exception as error:  # the store's host ended, or the group was torn down
                if self._stop.is_set() or active() is not self:
                    return
                # not a failure by itself: a job's ranks end at different times; a collective
                # in flight fails on its own. The store is not called again (each failed call
                # logs a C++ trace); timeouts and an end already decided are still kept.
                log.debug("fsdp_custom watchdog: store call failed, not used any more: %s", error)
                self._store_lost = True
            known = len(self._identities) == self.world or self._store_lost
            if self._stop.wait(self.interval if known else 0.05):
                return

    def _learn_identities(self) -> None:
        if len(self._identities) < self.world:
            self._identities.update({rank: json.loads(text) for rank, text in self._read("peer").items()})

    def _tick(self) -> None:
        if self._exit_at is not None and time.time() > self._exit_at:  # first: the store may be gone
            self._exit(self.error or self.abort_reason)
        if not self._store_lost:
            self._learn_identities()
            self._beats += 1
            self._store.set(f"beat/{self.rank}", str(self._beats))
            if self.abort_reason is None and self._store.check(["abort"]):
                self.abort_reason = self._store.get("abort").decode()
        self._check_device()
        now = time.time()
        while self._watched and (self._watched[0].ended is not None or _completed(self._watched[0], now)):
            self._watched.popleft()
        if self._watched and self.error is None and self._timed_out(self._watched[0]):
            self._fail_from_thread(self._watched[0], self._timeout_reason(self._watched[0]))
        if self.abort_reason is not None:
            self._end_outside_collective()

    def _check_device(self) -> None:
        while self._unverified and self._unverified[0][2].query():
            record, host, _ = self._unverified.popleft()
            if bool(host) and self.error is None:
                self._fail_from_thread(record, "the ranks issued different collectives here (order stamps differ)")

    def _fail_from_thread(self, record: CollectiveRecord, reason: str) -> None:
        try:
            self.fail(record, reason)
        except CollectiveError as error:
            self._exit(error)

    def _end_outside_collective(self) -> None:
        """Another rank failed while this one is not in a poll loop: report, then end."""
        if RECORDER.waiting is not None or self.error is not None or self.reported_own or self._exit_at:
            return
        self._exit_at = time.time() + self.grace
        latest = RECORDER.latest()
        doing = f"its last collective: {latest.describe()}" if latest is not None else "no collective issued"
        self._publish(f"rank {self.rank} was not waiting in a collective of the engine ({doing})", None, "outside")
        log.error("fsdp_custom: rank %d stops: %s", self.rank, self.abort_reason)

    @staticmethod
    def _exit(reason: Any) -> NoReturn:
        sys.stderr.write(f"fsdp_custom: ending this process: {reason}\n")
        _flush_and_exit()

    def stop(self) -> None:
        """Stop the thread (the process group is going away)."""
        self._stop.set()


def _completed(record: CollectiveRecord, now: float) -> bool:
    if record.work is None or not record.work.is_completed():
        return False
    record.ended, record.work = now, None
    return True


def _flush_and_exit() -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(1)


_ACTIVE: Watchdog | None = None
_ACTIVE_GROUP: Any = None
_STARTS = 0


def active() -> Watchdog | None:
    """The watchdog of the current default process group, if one runs."""
    if _ACTIVE is not None and dist.is_initialized() and dist.group.WORLD is _ACTIVE_GROUP:
        return _ACTIVE
    return None


def start(
    collective_timeout: float | None = DEFAULT_COLLECTIVE_TIMEOUT, node: int | None = None, fresh: bool = False
) -> Watchdog | None:
    """Start the watchdog of the default process group (once per group; later calls may only
    change ``collective_timeout``). ``fresh``: start a new one whatever runs (every rank must
    pass it at the same point: the Lightning strategy does at each run's setup, so a failure
    that a script caught and went on from is not reported again). Nothing without a group of
    two ranks or more."""
    global _ACTIVE, _ACTIVE_GROUP, _STARTS, _previous_excepthook
    running = active()
    if running is not None and not (fresh and running.error is None):
        running.collective_timeout = collective_timeout
        return running
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    if _ACTIVE is not None:
        _ACTIVE.stop()
    if _STARTS == 0:  # once per process: end a wedged process at exit, report uncaught exceptions
        atexit.register(_at_exit)
        _previous_excepthook, sys.excepthook = sys.excepthook, _report_uncaught
    _STARTS += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # an elastic restart keeps the agent's store
    prefix = f"fsdp_custom/watchdog/{restart}/{_STARTS}/"
    store = dist.PrefixStore(prefix, _client(dist.distributed_c10d._get_default_store()))
    if node is None:
        node = int(os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK") or 0)
    _ACTIVE = Watchdog(store, dist.get_rank(), dist.get_world_size(), node, collective_timeout)
    _ACTIVE_GROUP = dist.group.WORLD
    return _ACTIVE


def _client(store: Any) -> Any:
    """A connection of the watchdog's own (``clone``) with short timeouts, else the store itself."""
    try:
        store = store.clone()
    except (RuntimeError, AttributeError):
        pass
    store.set_timeout(STORE_TIMEOUT)
    return store


def _at_exit() -> None:
    """End a wedged process at once; otherwise stop the thread before the interpreter tears down
    what its store calls use (a thread left running can abort the exit in C++)."""
    if _ACTIVE is None:
        return
    if _ACTIVE.error is not None:
        _flush_and_exit()
    _ACTIVE.stop()
    _ACTIVE._thread.join(timeout=STORE_TIMEOUT.total_seconds() + 1)


def _report_uncaught(kind: type, error: BaseException, traceback: Any) -> None:
    watchdog = active()
    if watchdog is not None:
        watchdog.report_exception(error)
    _previous_excepthook(kind, error, traceback)


_previous_excepthook = sys.excepthook
