"""The engine's data-plane ``torch.distributed`` calls: stateless functions over a ``CommContext``.

They only move bytes: the data-plane collectives (all-gather, reduce-scatter, all-reduce and
all-to-all of tensors), all async. The blocking control-plane calls (object gathers, barriers,
groups) live in control.py. How a collective moves is chosen once per context and group: torch's
collectives, or for CPU tensors on gloo the context's exchange thread ([Note: point to point on
gloo] in exchange.py). What watches them is the context's observer: this module defines the
interface it reports to (``CollectiveObserver``, ``CollectiveWatch``) and monitoring.py implements
it (ledger, flight recorder, order stamps, watchdog), so no import leads from here to the
watchdog; a context without an observer moves the same bytes and watches nothing.

Every collective is issued with ``async_op=True`` and returned as a :class:`Pending` handle.
On gloo the process group's worker threads run it while Python goes on; ``wait()`` blocks the
host. On NCCL it runs on the process group's own communication stream (which first waits for the
stream that issued it), and ``wait()`` makes the *current* stream wait on its completion event
without blocking the host; NCCL records the tensors on its stream, so the caching allocator does
not reuse them early. A group of size 1 does a local copy and reports nothing. Reductions are
SUM followed by an explicit divide by the caller (see [Note: SUM then divide]).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from fsdp_strategy.engine import exchange
from fsdp_strategy.engine.flight import STAMP_SLOTS
from fsdp_strategy.engine.ledger import CollectiveKind

# [Note: SUM then divide]
# Gradients are reduced with ReduceOp.SUM and divided by the data-parallel size afterwards.
# gloo's ReduceOp.AVG was silently wrong in some torch releases (pytorch#162338), and an
# explicit divide keeps HYBRID_SHARD (two reductions) exact: one divide by the product.
# float16 (and any dtype narrower in range than bfloat16) overflows where the sum of N gradients
# exceeds 65504 while their mean fits, so there the divide is split as FSDP2 splits it: by a power
# of two near sqrt(N) before the sum and by the rest after it (``divide_factors``).

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def point_to_point_on_gloo() -> bool:
    """Whether CPU tensors on gloo go point to point ([Note: point to point on gloo]):
    ``FSDP_CUSTOM_GLOO_P2P=0`` gives them gloo's own collectives instead, the calls NCCL gets (one
    ``all_gather_into_tensor`` in place, ``reduce_scatter_tensor``, ``all_reduce``)."""
    value = os.environ.get("FSDP_CUSTOM_GLOO_P2P", "1")
    if value not in ("0", "1"):
        raise ValueError(f"FSDP_CUSTOM_GLOO_P2P={value!r}: accepted: '1' (point to point, the default) or '0'")
    return value == "1"


def divide_factors(data_parallel_size: int, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """``(before, after)``: the divisors applied to gradients before and after their SUM over
    ``data_parallel_size`` ranks; their product is that size ([Note: SUM then divide]). float32,
    bfloat16 and float64 divide once, after; other dtypes (float16) about sqrt(N) each side."""
    size = float(data_parallel_size)
    if reduce_dtype in (torch.float32, torch.bfloat16, torch.float64):
        return 1.0, size
    before = 1
    while size % before == 0 and size / before > before:
        before *= 2
    return float(before), size / before


class CollectiveWatch(Protocol):
    """One issued collective as its observer follows it (monitoring.py's ``Watch``)."""

    def stamp_rows(self, shard: torch.Tensor, output: torch.Tensor, size: int, group: Any) -> None:
        """All-gather: stamp ``shard``'s free tail; every row of ``output`` must hold it after the wait."""

    def stamp_sum(self, sent: torch.Tensor, summed: torch.Tensor, size: int, group: Any) -> None:
        """A SUM: stamp ``sent``; ``summed`` must hold ``size`` times it after the wait."""

    def wait(self, work: Any) -> None:
        """Wait for ``work`` (torch's or the exchange thread's handle) and check what was stamped."""


class CollectiveObserver(Protocol):
    """What the collectives report to: each one is announced by ``issue`` before it moves a byte and
    waited for through the returned watch. monitoring.py's ``CollectiveMonitor`` implements it."""

    def issue(
        self, kind: CollectiveKind, unit: str, dtype: torch.dtype, payload: int, wire: int, host_blocking: bool
    ) -> CollectiveWatch:
        """Record a collective about to be issued (raise if the job was stopped)."""

    def record_copy(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` the engine copied outside collectives (``gather_copy_in``, ...)."""

    def close(self) -> None:
        """Forget what was kept for this context's units."""


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


class CommContext:
    """What the collectives of one engine instance share: how they move (its exchange thread with
    its message tag, and what it learned once about each group: gloo or not, its peers) and the
    ``observer`` they report to (None: nothing watched). Owned by the Scheduler, ``close``d with it.
    Costs: one thread, started by the first point-to-point exchange."""

    def __init__(self, observer: CollectiveObserver | None = None, tag: int = exchange.DEFAULT_TAG) -> None:
        self.observer = observer
        self.exchange = exchange.ExchangeThread(tag)
        self.point_to_point = point_to_point_on_gloo()
        self._gloo: dict[int, bool] = {}
        self._peers: dict[tuple[int, int, int], exchange.Peers] = {}

    def exchanged(self, tensor: torch.Tensor, comm: CommGroup) -> bool:
        """Whether a collective of ``tensor`` on ``comm`` goes point to point ([Note: point to point on gloo]):
        CPU tensors on a gloo group ("gloo", or e.g. "cpu:gloo,cuda:nccl")."""
        if not self.point_to_point or tensor.is_cuda or comm.group is None:
            return False
        key = id(comm.group)
        if key not in self._gloo:
            self._gloo[key] = "gloo" in dist.get_backend(comm.group)
        return self._gloo[key]

    def peers(self, comm: CommGroup) -> exchange.Peers:
        """The other ranks of ``comm`` (computed once per group)."""
        key = (id(comm.group), comm.rank, comm.size)
        if key not in self._peers:
            self._peers[key] = exchange.peers_of(comm.group, comm.rank, comm.size)
        return self._peers[key]

    def issue(
        self, kind: CollectiveKind, unit: str, tensor: torch.Tensor, payload: int, wire: int
    ) -> CollectiveWatch | None:
        """Report a collective about to be issued to the observer (None without one)."""
        if self.observer is None:
            return None
        return self.observer.issue(kind, unit, tensor.dtype, payload, wire, host_blocking=not tensor.is_cuda)

    def record_copy(self, kind: str, nbytes: int) -> None:
        """Report ``nbytes`` copied outside collectives (a gather's copy-in, ...) to the observer, if any."""
        if self.observer is not None:
            self.observer.record_copy(kind, nbytes)

    def close(self) -> None:
        """Stop the exchange thread and forget what was learned about the groups."""
        self.exchange.close()
        self._gloo.clear()
        self._peers.clear()
        if self.observer is not None:
            self.observer.close()


class Pending:
    """A collective in flight; ``wait()`` makes its result usable (idempotent).

    On gloo ``wait()`` blocks the host, so the blocked time is the exposed communication. On
    NCCL it only makes the stream wait: the host-side times are then near zero and the
    device-side stall is not measured. With an observer the wait goes through its ``Watch``
    (the watchdog, the order stamps, the ledger's times).
    """

    def __init__(self, work: Any = None, watch: CollectiveWatch | None = None) -> None:
        self._work, self._watch = work, watch

    def wait(self) -> None:
        """Block (gloo) or make the stream wait (NCCL) until the collective is done."""
        if self._work is None:
            return
        work, self._work = self._work, None
        if self._watch is None:
            work.wait()
        else:
            self._watch.wait(work)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, comm: CommGroup, ctx: CommContext, unit: str, stamped: bool = False
) -> Pending:
    """Gather ``shard`` from every rank of ``comm`` into ``output`` (rank-major concatenation).

    ``stamped``: the last ``STAMP_SLOTS`` elements of ``shard`` are free for the order stamp,
    checked in every rank's row after the wait ([Note: order stamps]).
    """
    if comm.size == 1:
        output.copy_(shard)
        return Pending()
    payload = _nbytes(output)
    watch = ctx.issue(CollectiveKind.ALL_GATHER, unit, shard, payload, payload * (comm.size - 1) // comm.size)
    if stamped and watch is not None:
        watch.stamp_rows(shard, output, comm.size, comm.group)
    if ctx.exchanged(shard, comm):
        work = exchange.all_gather(output, shard, comm.group, comm.rank, ctx.peers(comm), ctx.exchange.tag)
        ctx.exchange.submit(work)
    else:
        work = _all_gather(output, shard, group=comm.group, async_op=True)
    return Pending(work, watch)


def reduce_scatter_scratch_numel(output: torch.Tensor, comm: CommGroup, ctx: CommContext) -> int:
    """Elements a reduce-scatter into ``output`` allocates besides it while in flight (point to
    point on gloo: the received slices of all peers but the first)."""
    return exchange.scratch_numel(output, comm.size) if ctx.exchanged(output, comm) else 0


def reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, comm: CommGroup, ctx: CommContext, unit: str, stamped: bool = False
) -> Pending:
    """SUM ``full`` over ``comm`` and leave this rank's 1/N slice in ``output``.

    ``stamped``: the last ``STAMP_SLOTS`` elements of each rank's slice are free for the order
    stamp, whose sum is checked after the wait ([Note: order stamps]).
    """
    if comm.size == 1:
        output.copy_(full)
        return Pending()
    payload = _nbytes(full)
    watch = ctx.issue(CollectiveKind.REDUCE_SCATTER, unit, full, payload, payload * (comm.size - 1) // comm.size)
    if stamped and watch is not None:
        watch.stamp_sum(full.view(comm.size, -1)[:, -STAMP_SLOTS:], output[-STAMP_SLOTS:], comm.size, comm.group)
    if ctx.exchanged(full, comm):
        work = exchange.reduce_scatter(output, full, comm.group, comm.rank, ctx.peers(comm), ctx.exchange.tag)
        ctx.exchange.submit(work)
    else:
        work = _reduce_scatter(output, full, op=dist.ReduceOp.SUM, group=comm.group, async_op=True)
    return Pending(work, watch)


def all_reduce(
    tensor: torch.Tensor, comm: CommGroup, ctx: CommContext, unit: str, op: str = "sum", stamped: bool = False
) -> Pending:
    """Reduce ``tensor`` in place over ``comm`` with ``op`` ("sum" or "max").

    ``stamped`` (SUM only): the last ``STAMP_SLOTS`` elements are free for the order stamp.
    """
    if comm.size == 1:
        return Pending()
    payload = _nbytes(tensor)
    watch = ctx.issue(CollectiveKind.ALL_REDUCE, unit, tensor, payload, 2 * payload * (comm.size - 1) // comm.size)
    if stamped and op == "sum" and watch is not None:
        watch.stamp_sum(tensor[-STAMP_SLOTS:], tensor[-STAMP_SLOTS:], comm.size, comm.group)
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    work = dist.all_reduce(tensor, op=reduce_op, group=comm.group, async_op=True)
    return Pending(work, watch)


def all_to_all(
    output: torch.Tensor,
    sent: torch.Tensor,
    output_sizes: list[int],
    sent_sizes: list[int],
    comm: CommGroup,
    ctx: CommContext,
    unit: str,
) -> Pending:
    """Send ``sent_sizes[r]`` elements of ``sent`` to each rank r of ``comm`` and receive
    ``output_sizes[r]`` from each into ``output`` (rank-major): torch's ``all_to_all_single``."""
    if comm.size == 1:
        output.copy_(sent)
        return Pending()
    payload = _nbytes(sent)
    wire = payload - sent_sizes[comm.rank] * sent.element_size()
    watch = ctx.issue(CollectiveKind.ALL_TO_ALL, unit, sent, payload, wire)
    work = dist.all_to_all_single(output, sent, output_sizes, sent_sizes, group=comm.group, async_op=True)
    return Pending(work, watch)
