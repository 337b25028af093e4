"""Every rank runs with the thread count Lightning's DDP gives it (CPUs / processes per node, unless
OMP_NUM_THREADS is set), under Lightning's launcher, torchrun, SLURM and Fabric's launcher: before,
only rank 0 of Lightning's launcher got it, the others ran with torch's default (issue 55)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import free_port
from lightning.fabric.utilities.distributed import _suggested_max_num_threads

JOB = str(Path(__file__).with_name("thread_count_job.py"))


LAUNCHER_VARIABLES = (
    "OMP_NUM_THREADS",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _environment(**extra: str) -> dict[str, str]:
    """A shell's environment: without OMP_NUM_THREADS (the tests' own setting hid the bug) and without
    what a launcher in this process (an in-process Trainer of an earlier test) left in ``os.environ``."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _threads(outputs: list[str]) -> dict[int, tuple[int, str]]:
    found = {}
    for output in outputs:
        for rank, threads, omp in re.findall(r"THREADS rank=(\d+) threads=(\d+) omp=(\d+|None)", output):
            found[int(rank)] = (int(threads), omp)
    return found


def _run(command: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[:3000] + done.stderr[:3000]
    return done.stdout + done.stderr


def _slurm(rank: int, port: int) -> dict[str, str]:
    return _environment(
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NNODES="1",
        SLURM_JOB_NAME="train",
        SLURM_JOB_ID="4242",
        SLURM_NODELIST="127.0.0.1",
        SLURM_NODEID="0",
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


@pytest.mark.slow
def test_every_rank_gets_the_thread_count_ddp_gives_it(tmp_path):
    expected = _suggested_max_num_threads(2)
    runs = {}
    for loop, strategy in (("trainer", "ours"), ("trainer", "ddp"), ("fabric", "ours")):  # ddp: the reference
        command = [sys.executable, JOB, loop, strategy]
        runs[(loop, strategy, "Lightning's launcher")] = [_run(command, _environment(), tmp_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    runs[("trainer", "ours", "torchrun")] = [_run([*torchrun, JOB, "trainer", "ours"], _environment(), tmp_path)]
    port = free_port()
    tasks = [
        subprocess.Popen(
            [sys.executable, JOB, "trainer", "ours"],
            env=_slurm(rank, port),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    runs[("trainer", "ours", "SLURM")] = [task.communicate(timeout=300)[0] for task in tasks]
    for where, outputs in runs.items():
        threads = _threads(outputs)
        assert sorted(threads) == [0, 1], (where, outputs)
        if where[2] == "torchrun":  # torchrun sets OMP_NUM_THREADS=1 for several processes per node itself
            assert {t for t, _ in threads.values()} == {1}, (where, threads)
            continue
        assert threads == {0: (expected, str(expected)), 1: (expected, str(expected))}, (where, threads)
