"""What moving one unit's bytes costs on gloo, apart from the engine's hooks (issue 55).

    python benchmarks/transport_cost.py            # about 1 minute here

2 ranks, gloo, one thread each. Per "unit": the three collectives a FULL_SHARD unit issues per step
(forward all-gather, backward all-gather, reduce-scatter) of a shard of ``numel`` float32 elements
(25,000: a block of the tiny-blocks GPT of ``unit_cost.py`` at world 2), each issued, then
``--busy`` µs of Python work on the training thread (the hooks and compute that overlap it),
then waited for. Two transports: the engine's point-to-point exchange (``fsdp_strategy.engine.
exchange``: its thread posts and waits for isend/irecv) and gloo's own collectives
(``all_gather_into_tensor`` / ``reduce_scatter_tensor``, async: what ``FSDP_CUSTOM_GLOO_P2P=0`` and
FSDP2 use). Printed per unit: the wall time beyond the busy work, and the CPU time of the
process's other threads (the exchange thread, gloo's threads): on 2 cores held by both ranks'
training threads, that CPU time is wall time the training threads wait for, whatever the engine's
own Python costs. Median of ``--rounds`` runs of ``--units`` units each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from spawn import spawn_ranks

TRANSPORTS = ("exchange", "gloo")


def _busy(seconds: float) -> None:
    """Python and small tensor ops on the training thread for ``seconds`` (the hooks' kind of work)."""
    end = time.perf_counter() + seconds
    scratch = torch.ones(4)
    while time.perf_counter() < end:
        scratch.add_(1)


def _unit(transport: str, buffers: dict, rank: int, world: int, thread, peers, busy: float) -> None:
    """The three collectives of one unit, each overlapped with ``busy`` seconds of work."""
    from fsdp_strategy.engine import exchange

    group = dist.group.WORLD
    for kind in ("gather", "gather", "reduce"):
        if transport == "exchange" and kind == "gather":
            work = thread.submit(exchange.all_gather(buffers["full"], buffers["shard"], group, rank, peers, thread.tag))
        elif transport == "exchange":
            work = thread.submit(
                exchange.reduce_scatter(buffers["out"], buffers["grads"], group, rank, peers, thread.tag)
            )
        elif kind == "gather":
            work = dist.all_gather_into_tensor(buffers["full"], buffers["shard"], async_op=True)
        else:
            work = dist.reduce_scatter_tensor(buffers["out"], buffers["grads"], async_op=True)
        _busy(busy)
        work.wait()


def _rank(rank: int, world: int, args: argparse.Namespace, rendezvous: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    from fsdp_strategy.engine import exchange

    thread = exchange.ExchangeThread()
    peers = exchange.peers_of(dist.group.WORLD, rank, world)
    buffers = {
        "shard": torch.randn(args.numel),
        "full": torch.empty(world * args.numel),
        "grads": torch.randn(world * args.numel),
        "out": torch.empty(args.numel),
    }
    busy = args.busy * 1e-6
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in TRANSPORTS}
    for _ in range(args.rounds):
        for transport in TRANSPORTS:
            _unit(transport, buffers, rank, world, thread, peers, busy)  # warm up
            dist.barrier()
            wall, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(args.units):
                _unit(transport, buffers, rank, world, thread, peers, busy)
            wall, cpu, own = (time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - own)
            results[transport].append(((wall - 3 * busy * args.units) / args.units, (cpu - own) / args.units))
    thread.close()
    dist.destroy_process_group()
    queue.put((rank, results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_000, help="float32 elements per shard")
    parser.add_argument("--busy", type=float, default=300.0, help="µs of work between each issue and its wait")
    parser.add_argument("--units", type=int, default=200, help="units per run")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = spawn_ranks(_rank, 2, 2, args, os.path.join(folder, "rendezvous"))
    print(f"shard {args.numel * 4 / 1024:.0f} KiB per rank, {args.busy:.0f} µs of work per collective, 2 ranks")
    print("| transport | wall beyond the work, ms per unit | other threads' CPU, ms per unit |")
    print("|---|---|---|")
    for transport in TRANSPORTS:
        rows = [row for rank in results.values() for row in rank[transport]]
        wall = statistics.median(row[0] for row in rows) * 1e3
        other = statistics.median(row[1] for row in rows) * 1e3
        print(f"| {transport} | {wall:.2f} | {other:.2f} |")


if __name__ == "__main__":
    main()
