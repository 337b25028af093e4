"""A job that loses a rank or a node restarts by itself and resumes exactly (tests/restart_job.py):
torchrun's restarts on the agent's own store, one node or two agents as two nodes; a node lost for
good under ``--nnodes=1:2``; SLURM's requeue signal (simulated: its environment and a stub
``scontrol``). Each is compared, loss for loss and bitwise, with an uninterrupted run or a run
resumed from the same checkpoint at the same world size.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from dist_utils import excerpt, free_port

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "restart_job.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FAULT_TO_TRAINING_LIMIT = 30.0  # seconds, on this 2-core machine


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _run(command: list[str], cwd: Path, timeout: float = 240, **env: str) -> str:
    done = subprocess.run(command, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, excerpt(output, 6000)
    return output


def _trained(root: Path, rank: int) -> dict[int, tuple[float, int]]:
    """``step -> (loss, world size)`` of ``rank``, the last attempt's record of each step."""
    lines = (root / "losses" / f"rank{rank}.jsonl").read_text().splitlines()
    return {e["step"]: (e["loss"], e["world"]) for e in map(json.loads, lines) if "loss" in e}


def _starts(root: Path, rank: int = 0) -> list[tuple[int, float]]:
    """``(global step, wall time)`` of every start of training on ``rank``."""
    lines = (root / "losses" / f"rank{rank}.jsonl").read_text().splitlines()
    return [(e["step"], e["time"]) for e in map(json.loads, lines) if e.get("event") == "started"]


def _fault_times(root: Path) -> list[float]:
    return [float((root / f"fault-{n}").read_text()) for n in range(len(list(root.glob("fault-*"))))]


def _assert_same_steps(job: Path, reference: Path, steps: range, world: int) -> None:
    for rank in range(2):
        got, want = _trained(job, rank), _trained(reference, rank)
        assert {s: got[s] for s in steps} == {s: want[s] for s in steps}, f"rank {rank}"
        assert all(got[s][1] == world for s in steps)


def _assert_quick_restarts(root: Path, resumed_at: list[int], limit: float = FAULT_TO_TRAINING_LIMIT) -> list[float]:
    """Each fault is followed by a start of training at the expected step within ``limit``
    seconds; returns the seconds from each fault to training again."""
    starts, faults = _starts(root), _fault_times(root)
    assert [step for step, _ in starts] == [0, *resumed_at]
    took = [start - fault for (_, start), fault in zip(starts[1:], faults)]
    assert all(0 < t < limit for t in took), took
    return took


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The job at world 2 under Lightning's launcher, without a fault: the oracle of the slow tests."""
    root = tmp_path_factory.mktemp("uninterrupted")
    _run([sys.executable, JOB, "--root", str(root), "--devices", "2"], root)
    return root


@pytest.mark.slow
def test_torchrun_restart_with_default_settings(tmp_path, uninterrupted):
    """The issue's command as it is: one node, c10d rendezvous, rank 1 SIGKILLed at step 7."""
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    command = [*TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", *rendezvous, JOB]
    _run([*command, "--root", str(tmp_path), "--kill-step", "7"], tmp_path)
    _assert_same_steps(tmp_path, uninterrupted, range(12), world=2)
    took = _assert_quick_restarts(tmp_path, resumed_at=[6])
    print(f"fault to training again: {took[0]:.1f} s")


@pytest.mark.slow
def test_torchrun_restarts_of_two_nodes_on_the_agents_store(tmp_path, uninterrupted):
    """Two agents as two nodes of one rank each; node 1's rank dies twice, so node 1's agent restarts
    twice while node 0's restarts for the membership change (their restart counts differ)."""
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d"]
    common += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"]
    job = [JOB, "--root", str(tmp_path), "--kill-step", "3", "7"]
    agents = [
        subprocess.Popen(
            [*TORCHRUN, *common, *job], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=300)[0].decode() for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(excerpt(o, 4000) for o in outputs)
    _assert_same_steps(tmp_path, uninterrupted, range(12), world=2)
    _assert_quick_restarts(tmp_path, resumed_at=[2, 6])


@pytest.mark.slow
def test_a_lost_node_leaves_the_job_to_the_other(tmp_path):
    """``--nnodes=1:2``: node 1 (agent and ranks) is SIGKILLed at step 7; node 0 goes on alone from
    ``last`` (step 6, written by 4 ranks) at world 2, equal to a run resumed from that checkpoint at
    world 2 under Lightning's launcher."""
    port = free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d"]
    common += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shrink", "--rdzv-conf", "last_call_timeout=5"]
    job = [JOB, "--root", str(tmp_path / "job"), "--kill-step", "7", "--kill-rank", "2", "--kill-node"]
    agents = []
    for _ in range(2):  # node 0 first: it hosts the rendezvous (torch's c10d backend ends with its host)
        agents.append(
            subprocess.Popen(
                [*TORCHRUN, *common, *job], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
        _wait_for(lambda: _listening(port), f"the rendezvous at port {port}", timeout=60)
    survivor = agents[0].communicate(timeout=300)[0].decode()
    agents[1].wait(timeout=60)
    assert agents[0].returncode == 0, excerpt(survivor, 6000)
    assert agents[1].returncode == -signal.SIGKILL
    resumed = tmp_path / "resumed"
    step6 = tmp_path / "job" / "checkpoints" / "step=6.ckpt"
    _run([sys.executable, JOB, "--root", str(resumed), "--devices", "2", "--ckpt-path", str(step6)], tmp_path)
    _assert_same_steps(tmp_path / "job", resumed, range(6, 12), world=2)
    assert {_trained(tmp_path / "job", 0)[s][1] for s in range(6)} == {4}
    # the rendezvous first waits out last_call_timeout for more nodes, and the lost node's heartbeats
    took = _assert_quick_restarts(tmp_path / "job", resumed_at=[6], limit=FAULT_TO_TRAINING_LIMIT + 15)
    print(f"node lost to training again on the other: {took[0]:.1f} s")


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _slurm_env(root: Path, bin_dir: Path, port: int, rank: int, restart: int) -> dict[str, str]:
    slurm = {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_RESTART_COUNT": str(restart),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return _env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **slurm)


def _slurm_job(root: Path, bin_dir: Path, restart: int, *args: str) -> list[subprocess.Popen]:
    """Both tasks of a one-node SLURM job step, as ``srun`` starts them."""
    port, log = free_port(), root / f"job{restart}"
    log.mkdir(exist_ok=True)
    command = [sys.executable, JOB, "--root", str(root), "--devices", "2", "--ckpt-path", "none", *args]
    return [
        subprocess.Popen(
            command,
            cwd=root,
            env=_slurm_env(root, bin_dir, port, rank, restart),
            stdout=open(log / f"rank{rank}.txt", "w"),
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]


def _wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_slurm_requeue_saves_sharded_and_resumes_exactly(tmp_path, uninterrupted):
    """SIGUSR1 reaches rank 1 only, while both ranks are inside step 4: Lightning's handler must
    run on both ranks at one step boundary (step 6), save ``hpc_ckpt_1.ckpt`` (a sharded folder)
    and requeue; the requeued job resumes from it by itself (``fit(ckpt_path=None)``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    first = _slurm_job(tmp_path, bin_dir, 0, "--sigusr1-step", "4")
    logs = [tmp_path / "job0" / f"rank{rank}.txt" for rank in range(2)]
    try:
        _wait_for(lambda: all("WAITING" in log.read_text() for log in logs), "both ranks to reach step 4")
        first[1].send_signal(signal.SIGUSR1)
        (tmp_path / "signalled").write_text("")
        _wait_for(lambda: (tmp_path / "scontrol.log").exists(), "rank 0 to requeue the job")
        for task in first:  # what SLURM does to a requeued job: SIGTERM, then SIGKILL after KillWait (30 s)
            task.send_signal(signal.SIGTERM)
        # every rank stops at one batch boundary ([Note: preemption at an agreed step]), well inside KillWait
        ended = [task.wait(timeout=30) for task in first]
    finally:
        for task in first:
            task.kill()
    assert ended == [143, 143], ended
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert (tmp_path / "hpc_ckpt_1.ckpt").is_dir()
    second = _slurm_job(tmp_path, bin_dir, 1)
    assert [task.wait(timeout=240) for task in second] == [0, 0], (tmp_path / "job1" / "rank0.txt").read_text()
    assert "Restoring states from the checkpoint path at" in (tmp_path / "job1" / "rank0.txt").read_text()
    assert _starts(tmp_path)[-1][0] == 6
    _assert_same_steps(tmp_path, uninterrupted, range(12), world=2)


def _attempt(rank: int, port: int, delay: float, queue) -> None:
    """One rank of one attempt: the agreed store, a gloo group on it and an all-reduce. A key every
    rank writes after the all-reduce must not be there before it (an earlier attempt wrote it): the
    gloo group alone finds stale keys only by a race (whether a peer rewrites its address in time)."""
    import torch
    import torch.distributed as dist

    from fsdp_strategy.distributed import rendezvous

    time.sleep(delay)
    try:
        store = rendezvous.attempt_store("127.0.0.1", port, rank, 2, timedelta(seconds=10))
        earlier = store.check([f"attempt ended/{rank}"])
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=10))
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        dist.destroy_process_group()
        store.set(f"attempt ended/{rank}", "")
        queue.put((rank, "read a key of an earlier attempt" if earlier else total.item()))
    except Exception as error:  # the test prints it
        queue.put((rank, f"{type(error).__name__}: {error}"))


def _attempts(port: int, delays: list[float]) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=_attempt, args=(rank, port, delay, queue)) for rank, delay in enumerate(delays)]
    for process in ranks:
        process.start()
    results = dict(queue.get(timeout=90) for _ in ranks)
    for process in ranks:
        process.join(timeout=30)
    return results


def test_attempts_on_one_store_never_read_each_others_keys():
    """Three attempts of two ranks on one TCP store (the agent's, kept across restarts): rank 1
    late, then rank 0 late (it reads rank 1's hello of the earlier attempt first). Without the
    namespace the second attempt reads the first one's addresses."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for delays in ([0.0, 0.0], [0.0, 1.5], [1.5, 0.0]):
        assert _attempts(server.port, delays) == {0: 3.0, 1: 3.0}


def test_a_rank_that_never_comes_is_named():
    import torch.distributed as dist

    from fsdp_strategy.distributed import rendezvous

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(TimeoutError, match="0 joined, rank 2 never started"):
        server.set(f"{rendezvous.KEYS}hello/1", "a nonce of an earlier attempt")
        rendezvous.attempt_store("127.0.0.1", server.port, 0, 3, timedelta(seconds=2))
