"""Run a benchmark body in freshly spawned ranks and collect what each rank reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def spawn_ranks(target: Callable, world: int, *args: Any) -> dict[int, Any]:
    """Run ``target(rank, *args, queue)`` in ``world`` spawned processes; each puts ``(rank, result)``
    on the queue. Returns the results by rank. Costs: a fresh interpreter (torch import) per rank."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=target, args=(rank, *args, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    return results
