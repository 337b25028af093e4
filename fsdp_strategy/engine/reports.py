"""Reports: this rank's side of the job's failure reports ([Note: watchdog] in watchdog.py).

It publishes this rank's report (and, first wins, the job's ``abort`` key) with its flight
recorder ring dumped to a file, reads the other ranks' reports, identities and heartbeats, and
writes the message of a failure from them with diagnosis.py's sentences. Called by the watchdog
on a failure (main thread) and when it hears of another rank's (its thread).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from fsdp_strategy.engine import diagnosis
from fsdp_strategy.engine.channel import StoreChannel, StoreLost
from fsdp_strategy.engine.diagnosis import Peer, PeerState
from fsdp_strategy.engine.flight import CollectiveRecord, FlightRecorder

log = logging.getLogger(__name__)

GRACE = 5.0  # seconds a failing rank waits for the other ranks' reports before it writes its message


def main_thread_place(depth: int = 8) -> tuple[str, str]:
    """Where this process's main thread is now: (its innermost frame outside the engine, the
    strategy's watched collectives and torch, in one line; its last ``depth`` frames, as a traceback
    shows them). Read by the watchdog's thread when another rank stopped the job while this one was
    outside every collective."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "an unknown place", ""
    stack = traceback.extract_stack(frame)
    ours = os.sep + "fsdp_strategy" + os.sep
    skipped = (os.sep + "torch" + os.sep, ours + "engine" + os.sep, ours + "strategy_watchdog.py", "threading.py")
    own = [entry for entry in stack if not any(part in entry.filename for part in skipped)]
    where = (own or stack)[-1]
    code = f": {where.line}" if where.line else ""
    return f"{where.name} ({where.filename}:{where.lineno}{code})", "".join(traceback.format_list(stack[-depth:]))


class Reports:
    """Reports of one watchdog. Costs: store calls only on a failure (and learning identities)."""

    def __init__(
        self, channel: StoreChannel, identity: dict[str, Any], world: int, recorder: FlightRecorder, dump_dir: str
    ) -> None:
        self.channel = channel
        self.identity = identity
        self.rank, self.node, self.world = identity["rank"], identity["node"], world
        self.recorder = recorder
        self.identities: dict[int, dict[str, Any]] = {}  # every rank's, filled until all are known
        self.dump_dir = dump_dir  # where a failing rank writes its ring
        self.dump_path = ""  # this rank's ring, written when it fails
        self.abort_seen: str | None = None  # another rank's first report, as the watchdog's thread read it
        self.layout: tuple[int, int] | None = None  # (data_parallel, tensor_parallel) of a 2-D run, to name places

    def publish_raised(self, error: BaseException) -> None:
        """Publish this rank's own exception, naming the rank by its place on a 2-D run."""
        self.check_store_host()
        place = diagnosis.coordinates(self.rank, self.layout).removesuffix("; ")
        name = f"rank {self.rank} ({place})" if place else f"rank {self.rank}"
        self.publish(f"{name} raised {diagnosis.first_line(error)}", None, "raised")

    def publish_outside(self, abort: str, limit: float) -> None:
        """Another rank stopped the job (``abort``: its report) while this one is outside every
        collective: publish where this rank is (for that rank's message) and warn here that it goes on
        until its next collective, or ``limit`` seconds without one."""
        latest = self.recorder.latest()
        doing = f"its last collective: {latest.describe()}" if latest is not None else "no collective issued"
        place, stack = main_thread_place()
        self.publish(
            f"rank {self.rank} was not waiting in a collective of the engine: it was in {place} ({doing})",
            None,
            "outside",
        )
        log.warning(
            "fsdp_custom: rank %d (node %d) is outside every collective, in %s, while the job stopped: %s. It goes "
            "on and stops at its next collective%s. Its stack:\n%s",
            self.rank,
            self.node,
            place,
            (abort.splitlines() or [""])[0].removeprefix("fsdp_custom: "),
            f" (or in {limit:g} s if it issues none)" if math.isfinite(limit) else "",
            stack.rstrip(),
        )

    def publish(self, reason: str, record: CollectiveRecord | None, kind: str = "failed") -> None:
        """Write this rank's report (``kind``: "failed", "raised" or "outside") and, first wins, the abort key."""
        report = {**self.identity, "reason": reason, "kind": kind, "waiting": record is not None}
        latest = record or self.recorder.latest()
        report["latest"] = latest.as_dict() if latest is not None else None
        if kind == "failed":  # a real failure: this rank's ring goes to a file the message names
            report["dump"] = self.dump_path = self._dump(report)
        try:
            self.channel.set(f"report/{self.rank}", json.dumps(report))
            if kind != "outside":
                self.channel.set_first("abort", json.dumps({"rank": self.rank, "reason": reason, "kind": kind}))
        except StoreLost as error:  # the store's host is gone: the report stays local
            log.debug("fsdp_custom watchdog: cannot publish: %s", error)

    def _dump(self, report: dict[str, Any]) -> str:
        """Write this rank's ring into ``dump_dir`` (one file per rank: bounded); its path."""
        path = os.path.join(self.dump_dir, f"fsdp_custom_flight_rank{self.rank}.json")
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            with open(path, "w") as file:
                json.dump({**report, "ring": self.recorder.snapshot()}, file, indent=1)
        except OSError as error:
            return f"(not written: {error})"
        return path

    def first(self, fallback: str) -> str:
        try:
            text = self.channel.read("abort")
        except StoreLost:
            text = None
        return json.loads(text)["reason"] if text else (self.abort_seen or fallback)

    def message(self, record: CollectiveRecord | None, reason: str) -> str:
        """This rank's failure message, logged as it is learned ([Note: watchdog]). A SIGTERM that
        arrives meanwhile is handled after it: torchrun's agent sends one as soon as a rank dies,
        and Lightning's handler then broadcasts on the failed group, which raises out of whatever
        the main thread runs (the report lost). Costs: up to ``GRACE`` seconds of that delay."""
        with signals_deferred((signal.SIGTERM,)):
            return self._message(record, reason)

    def _message(self, record: CollectiveRecord | None, reason: str) -> str:
        where = record.describe() if record is not None else "no collective"
        place = diagnosis.coordinates(self.rank, self.layout)
        headline = f"fsdp_custom: rank {self.rank} ({place}node {self.node}) stopped at {where}: {reason}"
        self.check_store_host()
        self.publish(headline, record)
        first = self.first(headline)
        gone = "".join(f"; rank {r} has exited" for r in sorted(self.gone_locally()))
        earlier = f"; first report: {first}" if first != headline else ""
        log.error("%s%s%s", headline, earlier, gone)  # at once: a launcher may kill this rank next
        mine = record or self.recorder.latest()
        try:
            peers = self.peers_after_grace()
            lines = [diagnosis.peer_line(peer, mine.as_dict() if mine else None, GRACE, self.layout) for peer in peers]
        except StoreLost as error:  # what this host can still see: which processes have exited
            gone = [Peer(rank, self.identities.get(rank), PeerState.GONE) for rank in sorted(self.gone_locally())]
            lines = [diagnosis.store_unreachable_line(str(error))]
            lines += [diagnosis.peer_line(peer, None, GRACE, self.layout) for peer in gone]
        every = os.path.join(self.dump_dir, "fsdp_custom_flight_rank*.json")
        dumps = [f"Flight recorder rings: {every} (this rank: {self.dump_path})"]
        nccl_dump = _nccl_dump_prefix()
        if nccl_dump is not None:
            dumps.append(f"torch's NCCL flight recorder, dumped on its own timeout: {nccl_dump}<rank>")
        # at once too: the exception's text is printed only after Lightning's teardown, which
        # restores the default SIGTERM action, and torchrun's agent sends SIGTERM when a rank dies
        log.error("%s", diagnosis.peers_message(self.rank, self.node, lines, dumps, self.layout))
        return diagnosis.failure_message(headline, first, lines, dumps)

    def peers_after_grace(self) -> list[Peer]:
        """Every other rank's state, after waiting up to ``GRACE`` seconds for their reports."""
        self.learn_identities()
        beats_before = self.channel.read_ranks("beat", self.world)
        deadline = time.monotonic() + GRACE
        while True:
            reports = {rank: json.loads(text) for rank, text in self.channel.read_ranks("report", self.world).items()}
            gone = self.gone_locally()
            missing = [r for r in range(self.world) if r != self.rank and r not in reports and r not in gone]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        beats_after = self.channel.read_ranks("beat", self.world)
        peers = []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            identity = self.identities.get(rank)
            if rank in reports:
                peers.append(Peer(rank, identity, PeerState.REPORTED, reports[rank]))
            elif rank in gone:
                peers.append(Peer(rank, identity, PeerState.GONE))
            elif beats_before.get(rank) == beats_after.get(rank):
                local = identity is not None and identity["host"] == self.identity["host"]
                peers.append(Peer(rank, identity, PeerState.SILENT_ALIVE if local else PeerState.SILENT))
            else:
                peers.append(Peer(rank, identity, PeerState.ALIVE))
        return peers

    def check_store_host(self) -> None:
        """Declare the store lost, without calling it, once its host is known to have exited: global
        rank 0's process on this host when no torchrun agent hosts the store (Lightning's launcher,
        env://). A call to a store whose host is gone makes torch print a C++ trace per call, in
        front of the report that explains it."""
        if self.channel.lost is not None or os.environ.get("TORCHELASTIC_RUN_ID") or self.rank == 0:
            return
        host = self.identities.get(0)
        if host is not None and host["host"] == self.identity["host"] and process_gone(host["pid"]):
            self.channel.lost = "global rank 0, which hosts the store, has exited"

    def gone_locally(self) -> set[int]:
        """Ranks on this host whose process has exited."""
        host = self.identity["host"]
        return {r for r, who in self.identities.items() if who["host"] == host and process_gone(who["pid"])}

    def learn_identities(self) -> None:
        if len(self.identities) < self.world:
            found = self.channel.read_ranks("peer", self.world)
            self.identities.update({rank: json.loads(text) for rank, text in found.items()})


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...]) -> Iterator[None]:
    """Run the body with ``signums`` recorded instead of handled, then handle each one received
    once, with the handlers as they were. Only in the main thread (where Python runs handlers and
    may set them); a handler installed outside Python (``signal.getsignal`` gives None) is left."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {}
    for signum in signums:
        if signal.getsignal(signum) is not None:
            previous[signum] = signal.signal(signum, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def _nccl_dump_prefix() -> str | None:
    """Where torch's NCCL flight recorder dumps, if the default group uses NCCL."""
    if not dist.is_initialized() or "nccl" not in dist.get_backend():
        return None
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get(
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_"
    )
