"""Run a benchmark body in freshly spawned ranks and collect what each rank reports."""

from __future__ import annotations

import queue as queues
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

TIMEOUT_S = 1800  # the longest a benchmark run may take


def spawn_ranks(target: Callable, world: int, *args: Any) -> dict[int, Any]:
    """Run ``target(rank, *args, queue)`` in ``world`` spawned processes; each puts ``(rank, result)``
    on the queue. Returns the results by rank; raises as soon as a rank ends without its result, or
    after ``TIMEOUT_S``. Costs: a fresh interpreter (torch import) per rank."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=target, args=(rank, *args, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(results) < world:
            try:
                rank, result = queue.get(timeout=1.0)
                results[rank] = result
                continue
            except queues.Empty:
                pass
            dead = [
                f"rank {r} (exit code {p.exitcode})"
                for r, p in enumerate(procs)
                if r not in results and p.exitcode is not None
            ]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} ended without a result; its error is above")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} gave no result in {TIMEOUT_S} s")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return results
