"""The flight recorder: this process's last collectives, and the stamps that check their order.

[Note: flight recorder]
Every collective the engine issues, and every barrier or broadcast the strategy runs for
Lightning, appends a ``CollectiveRecord`` to a ring (like NCCL's flight recorder), the
watchdog's (one per job run, shared by the models it watches) or an engine's own without one:
sequence number (from 1, per process), kind, unit, dtype, bytes, iteration, issue and end time.
Ranks that run one program issue one sequence, so comparing the rings names where they parted;
the watchdog (watchdog.py) does that when a wait fails, outlives ``collective_timeout``, or a
stamp does not match. Costs: one small object and a deque append per collective; the ring keeps
the last ``RING_SIZE``.

[Note: order stamps]
A collective of the engine carries ``STAMP_SLOTS`` extra elements per rank: bits (0 or 1) that
hash its kind and unit. All-gather copies every rank's bits to every rank; a SUM reduction adds
them, and a sum of N bits equals N times this rank's bit only if all N are equal (exact in any
float dtype while N is below 2**(mantissa bits), 256 for bfloat16). So after its wait every rank
knows whether all ranks issued this very collective: two ranks on different units of one size
(a unit called an extra time on one rank) would otherwise mix their tensors silently, or hang.
The drift is named at the first collective where it happens. Costs: 16 elements per rank per
collective, one copy in and one comparison after the wait (on CUDA the comparison runs on the
device and is read by the watchdog from pinned memory once its event has passed: no sync).
"""

from __future__ import annotations

import os
import time
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import torch

RING_SIZE = 512
STAMP_SLOTS = 16


@dataclass
class CollectiveRecord:
    """One collective of this process."""

    seq: int  # its place in this process's sequence, from 1
    kind: str  # "all_gather", "reduce_scatter", "all_reduce", "barrier", "broadcast", ...
    unit: str  # the unit (or the Lightning call) it serves
    dtype: str  # element type of the buffer, "" for a control-plane call
    nbytes: int  # bytes of the full buffer
    iteration: int  # the engine's iteration (root forwards since start, from 1) when it was issued
    step: int | None  # the trainer's global step when it was issued (set by the strategy), or None
    issued: float  # time.time() at issue (wall clock, for people reading a dump)
    started: float  # time.monotonic() at issue: what deadlines are measured from
    ended: float | None = None  # time.time() when its wait returned; None while in flight
    work: Any = None  # the work handle while it is in flight and watched (NCCL), else None
    limit: float | None = None  # seconds it may wait before the watchdog stops the job; None: no limit

    def describe(self) -> str:
        """``all_gather #57 of unit 'blocks.3' (step 2, iteration 3)``."""
        step = f"step {self.step}, " if self.step is not None else ""
        return f"{self.kind} #{self.seq} of unit {self.unit!r} ({step}iteration {self.iteration})"

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values (the work handle left out)."""
        fields = asdict(self)
        for local in ("work", "started", "limit"):
            fields.pop(local)
        return fields

    def waited(self) -> float:
        """Seconds since it was issued (monotonic)."""
        return time.monotonic() - self.started

    def poll_completed(self) -> bool:
        """Whether its device-side work (NCCL) has completed; then ``ended`` is set and the work let go."""
        if self.work is None or not self.work.is_completed():
            return False
        self.ended, self.work = time.time(), None
        return True


class FlightRecorder:
    """A ring of ``CollectiveRecord`` ([Note: flight recorder])."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.ring: deque[CollectiveRecord] = deque(maxlen=size)
        self.seq = 0
        self.iteration = 0
        self.step: int | None = None  # the trainer's global step, kept by the strategy
        self.waiting: CollectiveRecord | None = None  # the record the main thread is blocked on now

    def issue(self, kind: str, unit: str, dtype: torch.dtype | None = None, nbytes: int = 0) -> CollectiveRecord:
        """Append and return the record of a collective being issued now."""
        self.seq += 1
        dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else ""
        record = CollectiveRecord(
            self.seq, kind, unit, dtype_name, nbytes, self.iteration, self.step, time.time(), time.monotonic()
        )
        self.ring.append(record)
        return record

    def latest(self) -> CollectiveRecord | None:
        """The collective this process is waiting for, else the last one it issued."""
        if self.waiting is not None:
            return self.waiting
        return self.ring[-1] if self.ring else None

    def snapshot(self, last: int | None = None) -> list[dict[str, Any]]:
        """The ring (its ``last`` records), oldest first, as dicts; safe from another thread."""
        for _ in range(3):
            try:
                records = list(self.ring)
                break
            except RuntimeError:  # appended to while copied by another thread
                continue
        else:
            records = []
        return [record.as_dict() for record in records[-last if last else 0 :]]


class Stamp:
    """The ``STAMP_SLOTS`` bits of one (kind, unit) ([Note: order stamps]), as tensors on demand."""

    def __init__(self, kind: str, unit: str) -> None:
        code = zlib.crc32(f"{kind}:{unit}".encode())
        self.bits = [(code >> index) & 1 for index in range(STAMP_SLOTS)]
        self._tensors: dict[tuple, torch.Tensor] = {}

    def tensor(self, dtype: torch.dtype, device: torch.device, times: int = 1) -> torch.Tensor:
        """The bits times ``times`` (the stamp after a SUM over ``times`` ranks), cached."""
        key = (dtype, device, times)
        cached = self._tensors.get(key)
        if cached is None:
            cached = self._tensors[key] = torch.tensor([bit * times for bit in self.bits], dtype=dtype, device=device)
        return cached


def stamp_exact(dtype: torch.dtype, ranks: int) -> bool:
    """Whether a SUM of ``ranks`` bits is exact in ``dtype`` ([Note: order stamps])."""
    if not dtype.is_floating_point:
        return True
    return ranks <= 2 / torch.finfo(dtype).eps


def enable_nccl_flight_recorder() -> None:
    """Turn on torch's own NCCL flight recorder and its dump on timeout, unless the user set them.
    Must run before the NCCL process group is created. Costs: torch's ring of 2,000 entries."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
