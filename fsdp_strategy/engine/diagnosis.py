"""The watchdog's decisions and the text of a failure report: whether a peer this rank waits on
is lost, and what each rank was doing when one of them stopped the job.

Pure functions (and ``PeerLiveness``, a pure state machine) of what the ranks published
([Note: watchdog]): reports, identities, heartbeats and the time they were read. Nothing here
touches a store, a clock, a thread or a process, so every decision and every sentence a user may
read is tested without starting one.

A report (one per rank that failed or saw a failure) is a dict: ``rank``, ``node``, ``host``,
``pid``, ``reason`` (one line), ``kind`` ("failed": a collective of that rank failed;
"raised": that rank's own code raised; "outside": it saw another rank's report while not in a
collective), ``waiting`` (it was blocked in the collective ``latest`` names) and ``latest``
(a ``CollectiveRecord.as_dict()``, or None).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple


class PeerState(str, Enum):
    """What the reporting rank knows of another rank when it writes its message."""

    REPORTED = "reported"  # the peer published a report: its own words say what it was doing
    GONE = "gone"  # the peer's process, on this host, has exited
    SILENT_ALIVE = "silent_alive"  # on this host and alive, but its heartbeat did not move
    SILENT = "silent"  # on another host, its heartbeat did not move: its process or host may be down
    ALIVE = "alive"  # its heartbeat moved, and it sent no report


class Peer(NamedTuple):
    """One other rank, as the reporting rank sees it."""

    rank: int
    identity: dict[str, Any] | None  # {"node", "host", "pid"} as the peer published it, or None if unknown
    state: PeerState
    report: dict[str, Any] | None = None  # its report, when ``state`` is REPORTED


class PeerLiveness:
    """Whether a rank this one waits on is lost, from heartbeats read while it waits long.

    A peer on this host is lost when its process has exited; one on another host when its
    heartbeat has not moved for ``silence`` seconds of this rank's own clock (no clocks are
    compared across hosts). The thread feeds it what it read; ``every`` paces the reads. Costs: a
    dict of one entry per rank."""

    def __init__(self, my_host: str, silence: float, every: float) -> None:
        self.my_host, self.silence, self.every = my_host, silence, every
        self._heard: dict[int, tuple[str, float]] = {}  # rank -> (last heartbeat seen, when it changed)
        self._next_read = 0.0

    def forget(self) -> None:
        """This rank is not waiting long (any more): silence is measured afresh next time."""
        self._heard.clear()

    def due(self, now: float) -> bool:
        """Whether to read the heartbeats now (then not again for ``every`` seconds)."""
        if now < self._next_read:
            return False
        self._next_read = now + self.every
        return True

    def lost(self, gone: set[int], beats: dict[int, str], hosts: dict[int, str], now: float) -> str | None:
        """The sentence for the first lost peer, or None: ``gone`` are ranks of this host whose
        process exited, ``beats`` each rank's heartbeat as read ``now``, ``hosts`` their hosts."""
        if gone:
            return f"rank {min(gone)} LOST, its process has exited"
        for rank, beat in beats.items():
            last = self._heard.get(rank)
            if last is None or last[0] != beat:
                self._heard[rank] = (beat, now)
            elif now - last[1] > self.silence and hosts.get(rank) != self.my_host:
                return f"rank {rank} sent no heartbeat for {self.silence:.0f} s (its process or host is down?)"
        return None


def describe(record: dict[str, Any]) -> str:
    """``all_gather #57 of unit 'blocks.3' (step 2, iteration 3)`` from a record's dict."""
    step = f"step {record['step']}, " if record.get("step") is not None else ""
    return f"{record['kind']} #{record['seq']} of unit {record['unit']!r} ({step}iteration {record['iteration']})"


def first_line(error: BaseException) -> str:
    """``TypeName: first line of its message`` (the name alone without one), at most 300 characters."""
    text = str(error).strip().splitlines()
    return (f"{type(error).__name__}: {text[0]}" if text else type(error).__name__)[:300]


def relation(report: dict[str, Any], mine: dict[str, Any] | None) -> str:
    """Where a reporting peer was, relative to this rank's own latest collective."""
    latest = report.get("latest")
    if latest is None:
        return f"has issued no collective; {report['reason']}"
    state = "waiting for" if report.get("waiting") else "last issued"
    text = f"{state} {describe(latest)}"
    if mine is not None:
        if latest["seq"] < mine["seq"]:
            text += f", BEHIND by {mine['seq'] - latest['seq']}"
        elif latest["seq"] > mine["seq"]:
            text += f", ahead by {latest['seq'] - mine['seq']}"
        elif (latest["kind"], latest["unit"]) != (mine["kind"], mine["unit"]):
            text += ", a DIFFERENT collective at the same place"
    if report.get("kind") in ("raised", "outside"):
        text += f"; {report['reason']}"
    return text


def coordinates(rank: int, layout: tuple[int, int] | None) -> str:
    """Where global ``rank`` is on a ``(data_parallel, tensor_parallel)`` ``layout`` (tensor parallel
    the inner dimension, as ``init_device_mesh`` lays it out): "data 1, tensor 1; " ("" without one)."""
    if layout is None:
        return ""
    return f"data {rank // layout[1]}, tensor {rank % layout[1]}; "


def peer_line(peer: Peer, mine: dict[str, Any] | None, silence: float, layout: tuple[int, int] | None = None) -> str:
    """One line of the message about ``peer``; ``silence``: seconds its heartbeat was watched;
    ``layout``: the 2-D run's sizes, to name where the peer is."""
    who = peer.identity or {"node": "?", "host": "?", "pid": "?"}
    where = coordinates(peer.rank, layout)
    name = f"rank {peer.rank} ({where}node {who['node']}, host {who['host']}, pid {who['pid']})"
    if peer.state is PeerState.REPORTED:
        assert peer.report is not None
        return f"{name}: {relation(peer.report, mine)}"
    if peer.state is PeerState.GONE:
        return (
            f"{name}: LOST, its process has exited (killed, out of memory, or aborted: its own output says why; "
            "gloo's \"Received data size doesn't match\" there means the ranks issued different collectives, "
            "e.g. a unit reached in backward on some ranks only)"
        )
    if peer.state is PeerState.SILENT_ALIVE:
        return (
            f"{name}: NOT RESPONDING, its process is alive but sent no heartbeat for {silence:.0f} s and no report "
            "(busy in code that holds the GIL, or stopped in a debugger?)"
        )
    if peer.state is PeerState.SILENT:
        return (
            f"{name}: NOT RESPONDING, no heartbeat for {silence:.0f} s and no report (its process or host may be down)"
        )
    return f"{name}: alive, sent no report"


def store_unreachable_line(error: str) -> str:
    """The line that replaces the peers' reports when the store cannot be read (the lines of the
    peers known to be gone on this host follow it)."""
    return (
        f"the store is unreachable ({error}): the process that hosts it (global rank 0 under Lightning's launcher "
        "or env://, the torchrun agent of node 0 under torchrun) has ended"
    )


def peers_message(
    rank: int, node: int, lines: list[str], dumps: list[str], layout: tuple[int, int] | None = None
) -> str:
    """What this rank knows of the others (the message less its headline), logged as soon as known."""
    where = coordinates(rank, layout)
    return "\n  ".join([f"fsdp_custom: rank {rank} ({where}node {node}) sees the other ranks:", *lines, *dumps])


def failure_message(headline: str, first: str | None, lines: list[str], dumps: list[str]) -> str:
    """The whole message: this rank's headline, the first report if another, a line per peer, the dumps."""
    parts = [headline]
    if first is not None and first != headline:
        parts.append(f"First report: {first}")
    parts += lines
    parts += dumps
    return "\n  ".join(parts)


def plural(count: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``: a count in a message."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def count_of(count: int) -> str:
    """``12,345``, ``6.7 M``: a count of elements in a message."""
    return f"{count / 1e6:.1f} M" if count >= 100_000 else f"{count:,}"
