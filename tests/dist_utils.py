"""Run a function on N forked ranks with gloo, a file:// rendezvous and a deadline.

The parent has imported torch already, so a fork costs ~0.1 s (spawn costs seconds). Each
rank runs with one thread; a rank's exception comes back to the parent with its traceback;
a rank still running at the deadline is killed and named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _child(rank: int, world: int, rendezvous: str, fn: Callable, args: tuple, queue: Any, env: dict) -> None:
    try:
        os.environ.update({key: value.format(rank=rank) for key, value in env.items()})
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: B036 - everything must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable, world: int, tmp_path: Path, *args: Any, timeout: float = 120.0, env: dict | None = None
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks; return each rank's result."""
    context = mp.get_context("fork")
    queue = context.Queue()
    rendezvous = str(tmp_path / f"rendezvous-{uuid.uuid4().hex}")
    processes = [
        context.Process(target=_child, args=(rank, world, rendezvous, fn, args, queue, env or {}))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(results) + len(errors) < world:
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except Exception:
                hung = [r for r in range(world) if r not in results]
                raise TimeoutError(f"ranks {hung} did not finish within {timeout:.0f} s") from None
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for process in processes:
            process.join(timeout=5 if not errors else 1)
            if process.is_alive():
                process.kill()
                process.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[rank] for rank in range(world)]
