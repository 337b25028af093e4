"""Run a function on N forked ranks with gloo, a file:// rendezvous and a deadline.

The parent has imported torch already, so a fork costs ~0.1 s (spawn costs seconds). Each
rank runs with one thread; a rank's exception comes back to the parent with its traceback;
a rank still running at the deadline is killed and named.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import queue as queue_module
import re
import socket
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=90)  # a collective waiting on a dead or hung rank fails after this


def _child(rank: int, world: int, rendezvous: str, fn: Callable, args: tuple, queue: Any, env: dict) -> None:
    try:
        os.environ.update({key: value.format(rank=rank) for key, value in env.items()})
        # one thread, and a Lightning launcher told so: a forked child that raises torch's thread count after
        # the parent used its OpenMP pool hangs (tests/test_threads.py checks real launchers without this)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
        )
        result = fn(rank, world, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)  # by value: tensors must not travel as shared-memory handles
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: B036 - everything must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable,
    world: int,
    tmp_path: Path,
    *args: Any,
    timeout: float = 120.0,
    env: dict | None = None,
    allow_failure: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks; return each rank's result.

    A rank that raises or dies fails the call (its traceback or exit code in the message);
    with ``allow_failure`` the failures come back as ``RankFailure`` results instead.
    """
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
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, payload = queue.get(timeout=0.5)
                if status == "ok":
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    results[rank] = RankFailure(rank, payload)
                continue
            except queue_module.Empty:
                pass
            for rank, process in enumerate(processes):
                if rank not in results and not process.is_alive() and queue.empty():
                    results[rank] = RankFailure(rank, f"died with exit code {process.exitcode}")
            if time.monotonic() > deadline:
                hung = [r for r in range(world) if r not in results]
                raise TimeoutError(f"ranks {hung} did not finish within {timeout:.0f} s")
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    failures = [r for r in results.values() if isinstance(r, RankFailure)]
    if failures and not allow_failure:
        raise AssertionError("\n".join(f"rank {f.rank} failed:\n{f.error}" for f in failures))
    return [results[rank] for rank in range(world)]


def free_port() -> int:
    """A TCP port free on this machine now (for a launcher's ``--master_port``; never a fixed one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RankFailure(NamedTuple):
    """What a rank that raised or died left behind."""

    rank: int
    error: str


def run_torchrun_nodes(script: str, args: list[str], port: int, cwd: Path, timeout: float = 300) -> list:
    """Run ``script`` as two torchrun "nodes" of two ranks on this machine; return each node's
    ``(returncode, output)``. Costs: four rank processes and two agents."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    common = ["--nnodes=2", "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *common, f"--node_rank={node}", script, *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [(node.returncode, output) for node, output in zip(nodes, outputs)]


FIRST_ERROR = re.compile(r"Traceback \(most recent call last\)|^\S*(Error|Exception)\b.*:", re.MULTILINE)


def excerpt(text: str, chars: int = 4000) -> str:
    """What a failed job printed, for an assertion message: its first error (from the first traceback or
    error line on) and its end, ``chars`` characters in all. The end alone often holds only a launcher's
    traceback (torchrun's, after a rank died), not the rank's own first error."""
    if len(text) <= chars:
        return text
    tail = text[-(chars // 2) :]
    first = FIRST_ERROR.search(text)
    start = 0 if first is None else max(0, first.start() - 300)
    if start >= len(text) - len(tail):  # the first error is in the end already
        return text[-chars:]
    head = text[start : start + chars // 2]
    skipped = len(text) - start - len(head) - len(tail)
    before = f"[{start} characters before the first error]\n" if start else ""
    return f"{before}{head}\n[... {max(skipped, 0)} characters ...]\n{tail}"


class LogLines(logging.Handler):
    """Keeps the messages of the INFO records a logger hands it (Lightning's rank_zero_info lines)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
