"""The engine's only ``torch.distributed`` calls, and the ledger that counts them.

The data-plane collectives (all-gather, reduce-scatter, all-reduce of tensors) are async and
counted; a few blocking control-plane ones (object gathers, barriers, groups) serve checkpoints.

Every collective is issued with ``async_op=True`` and returned as a :class:`Pending` handle.
On gloo the process group's worker threads run it while Python goes on; ``wait()`` blocks the
host. On NCCL it runs on the process group's own communication stream (which first waits for
the stream that issued it), and ``wait()`` makes the *current* stream wait on its completion
event without blocking the host; NCCL records the tensors on its stream, so the caching
allocator does not reuse them early. A group of size 1 does a local copy, counts nothing.

Reductions are SUM followed by an explicit divide by the caller (see [Note: SUM then divide]).
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fsdp_strategy.engine import watchdog
from fsdp_strategy.engine.flight import RECORDER, STAMP_SLOTS, CollectiveRecord, Stamp, stamp_exact
from fsdp_strategy.engine.trace import span
from fsdp_strategy.engine.watchdog import CollectiveError

# [Note: SUM then divide]
# Gradients are reduced with ReduceOp.SUM and divided by the data-parallel size afterwards.
# gloo's ReduceOp.AVG was silently wrong in some torch releases (pytorch#162338), and an
# explicit divide keeps HYBRID_SHARD (two reductions) exact: one divide by the product.

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# [Note: point to point on gloo]
# gloo's all_gather_into_tensor gathers into a fresh flat buffer of its own and copies it out,
# and its reduce_scatter_tensor is slower than an all_reduce of the same input. Measured on 2
# ranks of a 2-core machine, one thread each, 16 MiB shards: all-gather 44 ms wall / 33 ms CPU
# as gloo's collective, 24 ms / 16 ms point to point (world 3: 122 / 63 vs 41 / 18 ms). So on
# a gloo group with CPU tensors the engine moves the bytes itself with isend/irecv, straight
# between the caller's buffers: each rank sends its shard to every peer (all-gather), or each
# peer the rows it owns (reduce-scatter), and then adds the received rows to its own. Per rank
# (N-1)/N of the payload is sent, as in a ring. gloo's transport thread moves the bytes; the
# engine's exchange thread posts the transfers in issue order (posting can wait for a busy
# transport) and waits for them, so the caller's thread goes on computing and ``wait(timeout)``
# polls as a gloo collective's work does ([Note: watchdog]). One thread serves the process in the
# order collectives are issued, which is program order on every rank as long as one thread (the
# training loop) issues them, as the engine does. The messages carry a tag of their own, so a user's
# own point-to-point messages on the same group are never matched with the engine's. NCCL and
# CUDA tensors keep the collectives (NCCL's are the fast path there).
P2P_TAG = 0x46534450 % 2**31  # "FSDP"


class CollectiveKind(str, Enum):
    """The collectives the engine issues."""

    ALL_GATHER = "all_gather"  # gather a unit's shards before it runs
    REDUCE_SCATTER = "reduce_scatter"  # reduce a unit's gradients into shards
    ALL_REDUCE = "all_reduce"  # replicas' gradients (NO_SHARD / HYBRID_SHARD), clipping norms


class CommGroup(NamedTuple):
    """A process group and this rank's place in it (``group=None`` means a group of one)."""

    group: Any
    rank: int
    size: int

    @classmethod
    def of(cls, group: Any) -> CommGroup:
        """Describe ``group`` (None: this process alone)."""
        if group is None:
            return cls(None, 0, 1)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))


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

    def start_step(self) -> None:
        """Move the running counts to ``last_step`` and start counting from zero."""
        self.last_step = dict(self.current)
        self.last_step_per_unit = {unit: dict(kinds) for unit, kinds in self.per_unit.items()}
        self.last_step_copied = dict(self.copied)
        self.current = defaultdict(KindTotals)
        self.per_unit = defaultdict(lambda: defaultdict(KindTotals))
        self.copied = defaultdict(int)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """The running counts as plain dicts: ``{kind: {"calls", "payload_bytes", "wire_bytes"}}``."""
        return {kind: vars(totals).copy() for kind, totals in self.current.items()}


class Pending:
    """A collective in flight; ``wait()`` makes its result usable (idempotent) and times it.

    On gloo ``wait()`` blocks the host, so the blocked time is the exposed communication. On
    NCCL it only makes the stream wait: the host-side times are then near zero and the
    device-side stall is not measured. The wait goes through the watchdog ([Note: watchdog]),
    and a stamped collective's stamps are checked after it ([Note: order stamps]).
    """

    def __init__(
        self,
        work: Any = None,
        ledger: CommLedger | None = None,
        kind: Any = None,
        unit: str = "",
        record: CollectiveRecord | None = None,
        check: Callable[[CollectiveRecord], None] | None = None,
        host_blocking: bool = True,
    ) -> None:
        self._work = work
        self._ledger, self._kind, self._unit = ledger, kind, unit
        self._record, self._check, self._host_blocking = record, check, host_blocking
        self._issued = time.perf_counter()

    def wait(self) -> None:
        """Block (gloo) or make the stream wait (NCCL) until the collective is done; record times."""
        if self._work is None:
            return
        start = time.perf_counter()
        with span("wait_" + self._kind.value):
            _wait(self._work, self._record, self._host_blocking)
        end = time.perf_counter()
        self._work = None
        if self._check is not None:
            self._check(self._record)
        if self._ledger is not None:
            self._ledger.record_wait(self._kind, self._unit, end - self._issued, end - start)


class Exchange:
    """The isend/irecv works of one collective done point to point ([Note: point to point on gloo]).

    The exchange thread posts them (posting waits for gloo's transport, which may be busy with
    an earlier transfer: off the caller's thread) and waits for them, in issue order;
    ``wait(timeout)`` behaves as a gloo work's: it raises a RuntimeError saying "timed out" if
    they are not done yet, and the transfer's own error if one failed; then it runs ``finish``
    (the additions of a reduce-scatter) on the calling thread, once. The caller must not touch
    the buffers until ``wait`` returns. Costs: one queue entry and one event per collective.
    """

    def __init__(self, post: Callable[[], list[Any]], finish: Callable[[], None] | None = None) -> None:
        self._post = post
        self._finish = finish
        self._done = threading.Event()
        self._error: BaseException | None = None
        _EXCHANGE_THREAD.submit(self)

    def complete(self) -> None:
        """Post the transfers and block until they are done (on the exchange thread)."""
        try:
            for work in self._post():
                work.wait()
        except BaseException as error:  # handed to the waiting thread
            self._error = error
        finally:
            self._post = None
            self._done.set()

    def is_completed(self) -> bool:
        """Whether every transfer is done (``finish`` may not have run yet)."""
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the transfers (at most ``timeout``), then finish the collective."""
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"point-to-point exchange timed out after {seconds} s")
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return True


class _ExchangeThread:
    """One daemon thread per process that posts and waits for exchanges in issue order; started
    on first use, stopped at interpreter exit."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Exchange | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        atexit.register(self.stop)

    def submit(self, exchange: Exchange) -> None:
        """Queue ``exchange`` behind those already submitted (starts the thread if needed)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fsdp_custom-exchange", daemon=True)
                self._thread.start()
        self._queue.put(exchange)

    def _run(self) -> None:
        while (exchange := self._queue.get()) is not None:
            exchange.complete()

    def stop(self) -> None:
        """End the thread once the exchanges before this call are done (bounded: never blocks exit long)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=1.0)


_EXCHANGE_THREAD = _ExchangeThread()


@functools.cache
def _gloo(group: Any) -> bool:
    """Whether CPU tensors on ``group`` go through gloo ("gloo" or e.g. "cpu:gloo,cuda:nccl")."""
    return "gloo" in dist.get_backend(group)


def _exchanged(tensor: torch.Tensor, comm: CommGroup) -> bool:
    """Whether a collective of ``tensor`` on ``comm`` is done point to point ([Note: point to point on gloo])."""
    return not tensor.is_cuda and _gloo(comm.group)


@functools.cache
def _peers(group: Any, rank: int, size: int) -> tuple[tuple[int, int], ...]:
    """``(group rank, global rank)`` of every other rank of the group, in group-rank order."""
    return tuple((peer, dist.get_global_rank(group, peer)) for peer in range(size) if peer != rank)


def _exchange_all_gather(output: torch.Tensor, shard: torch.Tensor, comm: CommGroup) -> Exchange:
    rows = output.view(comm.size, -1)
    own = rows[comm.rank]
    if own.data_ptr() != shard.data_ptr():
        own.copy_(shard)
    peers = _peers(comm.group, comm.rank, comm.size)

    def post() -> list[Any]:
        works = []
        for peer, global_peer in peers:
            works.append(dist.irecv(rows[peer], src=global_peer, group=comm.group, tag=P2P_TAG))
            works.append(dist.isend(own, dst=global_peer, group=comm.group, tag=P2P_TAG))
        return works

    return Exchange(post)


def reduce_scatter_scratch_numel(output: torch.Tensor, comm: CommGroup) -> int:
    """Elements a reduce-scatter into ``output`` allocates besides it while in flight: the
    received slices of all peers but the first, on gloo with CPU tensors ([Note: point to point on gloo])."""
    if comm.size <= 2 or not _exchanged(output, comm):
        return 0
    return (comm.size - 2) * output.numel()


def _exchange_reduce_scatter(output: torch.Tensor, full: torch.Tensor, comm: CommGroup) -> Exchange:
    rows = full.view(comm.size, -1)
    peers = _peers(comm.group, comm.rank, comm.size)
    received = [output] + list(output.new_empty(len(peers) - 1, output.numel()))  # the first peer's rows in output

    def post() -> list[Any]:
        works = []
        for (peer, global_peer), into in zip(peers, received):
            works.append(dist.irecv(into, src=global_peer, group=comm.group, tag=P2P_TAG))
            works.append(dist.isend(rows[peer], dst=global_peer, group=comm.group, tag=P2P_TAG))
        return works

    later = {peer: into for (peer, _), into in zip(peers[1:], received[1:])}
    later[comm.rank] = rows[comm.rank]

    def add_rows() -> None:  # a fixed order: the first peer's rows (in output), then the rest in rank order
        for rank in sorted(later):
            output.add_(later[rank])

    return Exchange(post, add_rows)


def _wait(work: Any, record: CollectiveRecord, host_blocking: bool) -> None:
    dog = watchdog.active()
    if dog is None:
        work.wait()
        record.ended = time.time()
    else:
        dog.wait(work, record, host_blocking)


def _issue(kind: CollectiveKind, unit: str, dtype: torch.dtype, nbytes: int) -> CollectiveRecord:
    """Record a collective about to be issued; raise if the job was stopped ([Note: watchdog])."""
    record = RECORDER.issue(kind.value, unit, dtype, nbytes)
    dog = watchdog.active()
    if dog is not None:
        dog.check_issue(record)
    return record


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@functools.cache
def _stamp(kind: CollectiveKind, unit: str) -> Stamp:
    return Stamp(kind.value, unit)


def _sum_stamp(
    kind: CollectiveKind, unit: str, sent: torch.Tensor, summed: torch.Tensor, comm: CommGroup
) -> Callable | None:
    """Write the stamp into ``sent`` (the slots of every row a SUM reads) and return the check of
    ``summed`` after the wait, or None where a sum of bits is not exact in the dtype."""
    stamp = _stamp(kind, unit)
    sent.copy_(stamp.tensor(sent.dtype, sent.device))
    if not stamp_exact(sent.dtype, comm.size):
        return None
    return _stamp_check(summed, stamp.tensor(sent.dtype, sent.device, comm.size), comm, False)


def _stamp_check(slots: torch.Tensor, expected: torch.Tensor, comm: CommGroup, per_rank: bool) -> Callable:
    """The check run after the wait: ``slots`` (after the collective) must equal ``expected``."""

    def check(record: CollectiveRecord) -> None:
        if slots.is_cuda:
            dog = watchdog.active()
            if dog is not None:
                dog.defer_check(record, (slots != expected).any())
            return
        if torch.equal(slots, expected):
            return
        reason = "the ranks issued different collectives here (order stamps differ)"
        if per_rank:
            others = [_global_rank(comm, row) for row in range(comm.size) if not torch.equal(slots[row], expected[row])]
            reason = f"ranks {others} issued a different collective here (their order stamps differ)"
        _fail(record, reason)

    return check


def _global_rank(comm: CommGroup, rank: int) -> int:
    return dist.get_global_rank(comm.group, rank) if comm.group is not None else rank


def _fail(record: CollectiveRecord, reason: str) -> None:
    dog = watchdog.active()
    if dog is None:
        raise CollectiveError(f"fsdp_custom: {record.describe()}: {reason}")
    dog.fail(record, reason)


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, comm: CommGroup, ledger: CommLedger, unit: str, stamped: bool = False
) -> Pending:
    """Gather ``shard`` from every rank of ``comm`` into ``output`` (rank-major concatenation).

    ``stamped``: the last ``STAMP_SLOTS`` elements of ``shard`` are free for the order stamp,
    checked in every rank's row after the wait ([Note: order stamps]).
    """
    if comm.size == 1:
        output.copy_(shard)
        return Pending()
    payload = _nbytes(output)
    kind = CollectiveKind.ALL_GATHER
    ledger.record(kind, unit, payload, payload * (comm.size - 1) // comm.size)
    check = None
    if stamped:
        stamp = _stamp(kind, unit).tensor(shard.dtype, shard.device)
        shard[-STAMP_SLOTS:].copy_(stamp)
        check = _stamp_check(output.view(comm.size, -1)[:, -STAMP_SLOTS:], stamp.expand(comm.size, -1), comm, True)
    record = _issue(kind, unit, shard.dtype, payload)
    if _exchanged(shard, comm):
        work = _exchange_all_gather(output, shard, comm)
    else:
        work = _all_gather(output, shard, group=comm.group, async_op=True)
    return Pending(work, ledger, kind, unit, record, check, not shard.is_cuda)


def reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, comm: CommGroup, ledger: CommLedger, unit: str, stamped: bool = False
) -> Pending:
    """SUM ``full`` over ``comm`` and leave this rank's 1/N slice in ``output``.

    ``stamped``: the last ``STAMP_SLOTS`` elements of each rank's slice are free for the order
    stamp, whose sum is checked after the wait ([Note: order stamps]).
    """
    if comm.size == 1:
        output.copy_(full)
        return Pending()
    payload = _nbytes(full)
    kind = CollectiveKind.REDUCE_SCATTER
    ledger.record(kind, unit, payload, payload * (comm.size - 1) // comm.size)
    check = None
    if stamped:
        check = _sum_stamp(kind, unit, full.view(comm.size, -1)[:, -STAMP_SLOTS:], output[-STAMP_SLOTS:], comm)
    record = _issue(kind, unit, full.dtype, payload)
    if _exchanged(full, comm):
        work = _exchange_reduce_scatter(output, full, comm)
    else:
        work = _reduce_scatter(output, full, op=dist.ReduceOp.SUM, group=comm.group, async_op=True)
    return Pending(work, ledger, kind, unit, record, check, not full.is_cuda)


def all_reduce(
    tensor: torch.Tensor, comm: CommGroup, ledger: CommLedger, unit: str, op: str = "sum", stamped: bool = False
) -> Pending:
    """Reduce ``tensor`` in place over ``comm`` with ``op`` ("sum" or "max").

    ``stamped`` (SUM only): the last ``STAMP_SLOTS`` elements are free for the order stamp.
    """
    if comm.size == 1:
        return Pending()
    payload = _nbytes(tensor)
    kind = CollectiveKind.ALL_REDUCE
    ledger.record(kind, unit, payload, 2 * payload * (comm.size - 1) // comm.size)
    check = None
    if stamped and op == "sum":
        check = _sum_stamp(kind, unit, tensor[-STAMP_SLOTS:], tensor[-STAMP_SLOTS:], comm)
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    record = _issue(kind, unit, tensor.dtype, payload)
    work = dist.all_reduce(tensor, op=reduce_op, group=comm.group, async_op=True)
    return Pending(work, ledger, kind, unit, record, check, not tensor.is_cuda)


def wedged() -> bool:
    """Whether a collective of this process failed ([Note: watchdog]): none can be waited for."""
    dog = watchdog.active()
    return dog is not None and dog.error is not None


@contextmanager
def watched(kind: str, name: str) -> Iterator[None]:
    """Run a blocking call of the default group (a barrier, a broadcast) under the watchdog: it
    is recorded ([Note: flight recorder]), timed by the thread, and a failure of it becomes a
    ``CollectiveError`` naming where every rank was. Costs: one record."""
    dog = watchdog.active()
    if dog is None or threading.current_thread() is not threading.main_thread():  # a background save
        yield
        return
    record = RECORDER.issue(kind, name)
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


# ---- small control-plane collectives (checkpoints): blocking, pickled Python objects ----------


def process_rank(group: Any = None) -> tuple[int, int]:
    """(rank, size) in ``group``, or (0, 1) without a process group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (pickled), in rank order; blocking."""
    _, size = process_rank(group)
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    with watched("all_gather_object", "checkpoint"):
        dist.all_gather_object(out, value, group=group)
    return out


def all_gather_rows(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order, shape ``(world, *tensor.shape)``; blocking."""
    _, size = process_rank(group)
    if size == 1:
        return tensor.unsqueeze(0).clone()
    out = tensor.new_empty(size * tensor.numel())
    with watched("all_gather", "sync_batchnorm"):
        dist.all_gather_into_tensor(out, tensor.reshape(-1).contiguous(), group=group)
    return out.view(size, *tensor.shape)


def all_reduce_sum_(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in place; blocking (no-op for one rank)."""
    if process_rank(group)[1] > 1:
        with watched("all_reduce", "sync_batchnorm"):
            dist.all_reduce(tensor, group=group)
    return tensor


@torch.no_grad()
def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Overwrite ``tensors`` in place with global rank 0's values (``sync_module_states``); blocking.

    Costs: one broadcast per tensor (setup only). No-op without a process group.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with watched("broadcast", "sync_module_states"):
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)


def barrier(group: Any = None) -> None:
    """Wait until every rank of ``group`` arrives (no-op without a process group)."""
    if dist.is_initialized():
        with watched("barrier", "checkpoint"):
            dist.barrier(group=group)


def new_gloo_group() -> Any:
    """A new gloo group of all ranks (a collective: every rank calls it), or None without one."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def destroy_group(group: Any) -> None:
    """Release a group made by ``new_gloo_group``."""
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)
