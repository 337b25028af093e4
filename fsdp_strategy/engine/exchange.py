"""Point-to-point all-gather and reduce-scatter on gloo, posted and waited by a thread of the engine.

[Note: point to point on gloo]
gloo's all_gather_into_tensor gathers into a fresh flat buffer of its own and copies it out,
and its reduce_scatter_tensor is slower than an all_reduce of the same input. So on a gloo group
with CPU tensors the engine moves the bytes itself with isend/irecv, straight between the
caller's buffers: each rank sends its shard to every peer (all-gather), or each peer the rows it
owns (reduce-scatter), and then adds the received rows to its own in a fixed order. Per rank
(N-1)/N of the payload is sent, as in a ring (figures in docs/benchmarks.md). gloo's transport
thread moves the bytes; the engine's exchange thread posts the transfers in issue order (posting
can wait for a busy transport) and waits for them, so the caller's thread goes on computing and
``wait(timeout)`` polls as a gloo collective's work does ([Note: watchdog]). Each engine instance
has its own thread and its own message tag, agreed by every rank when the model is sharded: its
collectives are issued in program order by one training thread, so its thread posts them in the
same order on every rank, and the messages of two models (or a user's own, tag 0) never match
each other. NCCL and CUDA tensors keep the collectives (NCCL's are the fast path there).
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TAG = 0x46534450 % 2**31  # "FSDP": the tag of an engine built without a process group


class Exchange:
    """The isend/irecv works of one collective done point to point.

    The exchange thread posts them and waits for them, in issue order; ``wait(timeout)``
    behaves as a gloo work's: it raises a RuntimeError saying "timed out" if they are not done
    yet, and the transfer's own error if one failed; then it runs ``finish`` (the additions of a
    reduce-scatter) on the calling thread, once. The caller must not touch the buffers until
    ``wait`` returns. Costs: one queue entry and one event per collective.
    """

    def __init__(self, post: Callable[[], list[Any]], finish: Callable[[], None] | None = None) -> None:
        self._post: Callable[[], list[Any]] | None = post
        self._finish = finish
        self._done = threading.Event()
        self._error: BaseException | None = None

    def complete(self) -> None:
        """Post the transfers and block until they are done (on the exchange thread)."""
        try:
            assert self._post is not None
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


class ExchangeThread:
    """The thread of one engine instance that posts and waits for its exchanges in issue order,
    with the instance's message ``tag``; started on first use, stopped by ``close``."""

    def __init__(self, tag: int = DEFAULT_TAG) -> None:
        self.tag = tag
        self._queue: queue.SimpleQueue[Exchange | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, exchange: Exchange) -> Exchange:
        """Queue ``exchange`` behind those already submitted (starts the thread if needed)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fsdp_custom-exchange", daemon=True)
                self._thread.start()
        self._queue.put(exchange)
        return exchange

    def _run(self) -> None:
        while (exchange := self._queue.get()) is not None:
            exchange.complete()

    def close(self) -> None:
        """End the thread once the exchanges before this call are done (bounded: a transfer stuck on
        a dead peer does not hold the caller longer than a second)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=1.0)


def agree_on_tag(group: Any) -> int:
    """The message tag of an engine that shards over ``group``, the same on every rank of it: the
    k-th model each rank shards over that group takes the k-th tag of the group. Each rank counts
    its own in the default store, so it costs one store call and no collective, and draws from no
    random generator. Without a group (a group of one) the default tag."""
    if group is None or not dist.is_initialized():
        return DEFAULT_TAG
    members = ",".join(map(str, dist.get_process_group_ranks(group)))
    store = dist.distributed_c10d._get_default_store()
    count = store.add(f"fsdp_custom/exchange_tags/{members}/{dist.get_rank()}", 1)
    return (1 << 20) + (zlib.crc32(members.encode()) % (1 << 20)) * 512 + count % 512


Peers = tuple[tuple[int, int], ...]  # (group rank, global rank) of every other rank, in group-rank order


def peers_of(group: Any, rank: int, size: int) -> Peers:
    """``(group rank, global rank)`` of every other rank of ``group``."""
    return tuple((peer, dist.get_global_rank(group, peer)) for peer in range(size) if peer != rank)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: Any, rank: int, peers: Peers, tag: int) -> Exchange:
    """Each rank's ``shard`` into its row of ``output`` (rank-major), sent straight between the buffers."""
    rows = output.view(len(peers) + 1, -1)
    own = rows[rank]
    if own.data_ptr() != shard.data_ptr():
        own.copy_(shard)

    def post() -> list[Any]:
        works = []
        for peer, global_peer in peers:
            works.append(dist.irecv(rows[peer], src=global_peer, group=group, tag=tag))
            works.append(dist.isend(own, dst=global_peer, group=group, tag=tag))
        return works

    return Exchange(post)


def scratch_numel(output: torch.Tensor, size: int) -> int:
    """Elements a reduce-scatter into ``output`` over ``size`` ranks allocates besides it while in
    flight: the received slices of all peers but the first."""
    return 0 if size <= 2 else (size - 2) * output.numel()


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: Any, rank: int, peers: Peers, tag: int) -> Exchange:
    """SUM of every rank's slice ``rank`` of ``full`` into ``output``, in a fixed order: the first
    peer's rows (received into ``output``), then the rest and this rank's own in rank order."""
    rows = full.view(len(peers) + 1, -1)
    received = [output] + list(output.new_empty(len(peers) - 1, output.numel()))

    def post() -> list[Any]:
        works = []
        for (peer, global_peer), into in zip(peers, received):
            works.append(dist.irecv(into, src=global_peer, group=group, tag=tag))
            works.append(dist.isend(rows[peer], dst=global_peer, group=group, tag=tag))
        return works

    later = {peer: into for (peer, _), into in zip(peers[1:], received[1:])}
    later[rank] = rows[rank]

    def add_rows() -> None:
        for source in sorted(later):
            output.add_(later[source])

    return Exchange(post, add_rows)
