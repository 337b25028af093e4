"""How long the watchdog lets a rank wait, and how it ends a wedged process ([Note: watchdog] in
watchdog.py): the poll and heartbeat periods, the silence after which a peer on another host is
taken for dead, the limits of the engine's collectives and of blocking control-plane calls (from
``collective_timeout`` and the process group's own timeout), and the exit of a process that cannot
exit normally."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

POLL = timedelta(seconds=0.2)
HEARTBEAT = 1.0  # seconds between heartbeats
SILENCE = 60.0  # seconds without a heartbeat after which a rank on another host, waited on, is taken for dead
PEER_CHECK_AFTER = 2.0  # a wait this old makes the thread look at the peers (then every as many seconds)
CONTROL_MARGIN = 30.0  # seconds the thread gives a blocking call beyond the process group's timeout
ORPHAN_GRACE = 3.0  # seconds a failed job's rank outside every collective outlives the process that started it


class Limits(NamedTuple):
    """Seconds a call may wait before the watchdog stops the job (``math.inf``: no limit)."""

    collective: float  # the engine's collectives: ``collective_timeout``
    control: float  # blocking control-plane calls: past the process group's own timeout


def process_group_timeout(group: Any = None) -> float:
    """Seconds of ``group``'s (default: the default group's) own timeout, torch's default if unknown."""
    group = group or dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (RuntimeError, AttributeError, ValueError):
            continue
    return dist.default_pg_timeout.total_seconds()


def limits_for(collective_timeout: float | None) -> Limits:
    """The limits of the default group: ``collective_timeout`` (None: the group's own timeout)."""
    group_timeout = process_group_timeout()
    collective = group_timeout if collective_timeout is None else collective_timeout
    return Limits(collective, max(collective, group_timeout) + CONTROL_MARGIN)


def flush_and_exit() -> NoReturn:
    """End this process at once (``os._exit(1)``), its output flushed: a rank whose collective
    failed cannot exit normally ([Note: watchdog] in watchdog.py)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(1)
