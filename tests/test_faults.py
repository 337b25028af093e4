"""A rank that dies, raises, hangs or drifts ends the whole job fast, and every surviving rank
says which rank and where ([Note: watchdog]); a save killed midway loses nothing; a healthy job
is never ended (a caught exception, a slow rank-0 save, SIGTERM to every rank).

Each case is a real Lightning job (tests/faulty_job.py, gloo, 2 ranks) under Lightning's own
launcher (``python train.py``), torchrun, or two torchrun "nodes", run with a deadline; the test
asserts the time the job took to end and the words of the error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from dist_utils import excerpt, free_port, run_torchrun_nodes

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "faulty_job.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
DEADLINE = 30.0  # seconds from the fault to the end of every rank (the bound)


def _seconds_after_fault(output: str, start: float) -> float:
    """Seconds from the fault the job printed (``FAULT at <time>``) to now, the end of every process;
    from ``start`` (a ``time.time()``) where it printed none. Not from the start: four ranks
    importing torch on two cores take 20 s or more under load before any fault."""
    printed = [float(seconds) for seconds in re.findall(r"^FAULT at (\d+\.\d+)$", output, re.MULTILINE)]
    return time.time() - min(printed, default=start)


def _run(*args: str, torchrun: tuple[str, ...] | None = None, timeout: float = 120) -> tuple[int, str, float]:
    """Run the job (its output, return code and seconds from the fault to the end of every process)."""
    command = [sys.executable, JOB, *args]
    if torchrun is not None:
        command = [sys.executable, "-m", "torch.distributed.run", *torchrun, JOB, *args]
    start = time.time()
    job = subprocess.run(  # a session of its own: save_kill_all kills its whole process group
        command, env=ENV, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    output = job.stdout + job.stderr
    return job.returncode, output, _seconds_after_fault(output, start)


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("kill", ["rank 1 (node 0", "LOST, its process has exited", "stopped at all_gather #"]),
        ("exit", ["rank 1 (node 0", "LOST, its process has exited", "of unit 'net.blocks"]),
        ("raise", ["rank 1 raised ValueError: injected failure in training_step"]),
    ],
)
def test_a_rank_that_dies_or_raises_ends_the_job_naming_it(fault, words):
    code, output, seconds = _run("--fault", fault, "--rank", "1", "--step", "3")
    assert code != 0 and "FINISHED" not in output
    assert seconds < DEADLINE, excerpt(output, 3000)
    assert "CollectiveError: fsdp_custom: rank 0 (node 0) stopped at" in output, excerpt(output, 4000)
    for word in words:
        assert word in output, (word, excerpt(output, 4000))


def test_a_rank_that_dies_under_tensor_parallel_is_named():
    """Its peers first fail in tensor parallel's own collectives (DTensor's, inside the forward), which
    the engine does not issue: torch's bare "Connection reset by peer" becomes the CollectiveError."""
    code, output, seconds = _run("--fault", "kill", "--rank", "1", "--step", "3", "--tensor-parallel", "2")
    assert code != 0 and "FINISHED" not in output
    assert seconds < DEADLINE, excerpt(output, 3000)
    headline = "CollectiveError: fsdp_custom: rank 0 (data 0, tensor 0; node 0) stopped at no collective: a collective "
    assert headline + "outside the engine (tensor parallel, the user's own) failed: RuntimeError" in output, excerpt(
        output, 4000
    )
    assert "rank 1 (data 0, tensor 1; node 0" in output and "LOST, its process has exited" in output


def test_a_hang_ends_at_collective_timeout_with_every_ranks_place():
    code, output, seconds = _run("--fault", "hang", "--rank", "1", "--step", "3", "--collective-timeout", "5")
    assert code != 0 and "FINISHED" not in output
    assert seconds < DEADLINE, excerpt(output, 3000)
    assert "collective_timeout=5 s" in output, excerpt(output, 4000)
    # rank 1 sleeps in training_step: it is behind, outside any collective, and says so
    assert "BEHIND by" in output and "rank 1 was not waiting in a collective of the engine" in output
    # rank 1 logs its own place (the job's sleep) and stack, then is ended, saying why then, once
    place = "rank 1 (node 0) is outside every collective, in training_step (" + JOB
    assert place in output and "time.sleep(600)" in output.split(place, 1)[1], excerpt(output, 4000)
    ended = re.search(r"fsdp_custom: ending this process \((.*?)\): (.*)", output)
    assert ended and ended.group(1) in (
        "the process that started this rank exited 3 s before",  # the launcher (rank 0) exited first
        "this rank issued no collective for 5 s after it",
    ), excerpt(output, 4000)
    assert "fsdp_custom:" not in ended.group(2) and "no collective for" not in ended.group(2)


def test_a_rank_due_to_end_whose_launcher_exited_ends_three_seconds_later():
    """The orphan rule alone (the hang above may end either way, by timing): a deadline set, the
    parent process changes, the deadline moves to ORPHAN_GRACE s from now, never later."""
    import threading

    from fsdp_strategy.engine.watch_limits import ORPHAN_GRACE
    from fsdp_strategy.engine.watchdog import Watchdog

    dog = Watchdog.__new__(Watchdog)
    dog._lock, dog._launcher, dog._end_at, dog._end_why = threading.Lock(), 100, None, ""
    dog._end_sooner_if_orphaned(1)  # no deadline: a healthy rank is never ended for its launcher
    assert dog._end_at is None and dog._launcher == 100
    dog._end_at, dog._end_why = time.monotonic() + 60, "this rank issued no collective for 60 s after it"
    dog._end_sooner_if_orphaned(100)
    assert dog._end_at > time.monotonic() + 50
    dog._end_sooner_if_orphaned(1)
    assert abs(dog._end_at - (time.monotonic() + ORPHAN_GRACE)) < 0.5 and ORPHAN_GRACE == 3.0
    assert dog._end_why == "the process that started this rank exited 3 s before"
    dog._end_at = time.monotonic() + 1
    dog._end_sooner_if_orphaned(2)  # sooner already: kept
    assert dog._end_at < time.monotonic() + 1.01


def test_a_drift_is_named_at_the_first_mismatched_collective():
    # rank 1 calls block 0 once more at step 3; block 1 has the same size, so gloo alone would
    # mix the two units' parameters silently
    code, output, seconds = _run("--fault", "drift", "--rank", "1", "--step", "3")
    assert code != 0 and "FINISHED" not in output
    assert seconds < DEADLINE
    assert "issued a different collective here" in output, excerpt(output, 4000)
    assert "all_gather #" in output and "of unit 'net.blocks.0'" in output and "of unit 'net.blocks.1'" in output
    assert "a DIFFERENT collective at the same place" in output


def test_the_death_of_rank_0_that_hosts_the_store_ends_rank_1():
    code, output, seconds = _run("--fault", "kill", "--rank", "0", "--step", "3")
    assert code != 0 and "FINISHED" not in output
    assert seconds < DEADLINE, excerpt(output, 3000)
    assert "rank 1 (node 0) stopped at" in output, excerpt(output, 4000)
    assert "the store is unreachable" in output and "rank 0 (node 0, host" in output
    assert "LOST, its process has exited" in output
    # the report comes first: no C++ trace of torch's store (a call to a dead store) in front of it
    assert "Exception raised from" not in output and "frame #" not in output, output[:4000]
    assert output.index("fsdp_custom: rank 1 (node 0) stopped at") < output.index("Traceback")


def test_a_dead_rank_under_torchrun_is_named():
    code, output, seconds = _run(
        "--fault", "kill", "--rank", "1", torchrun=("--nproc_per_node=2", f"--master_port={free_port()}")
    )
    assert code != 0
    assert seconds < DEADLINE, excerpt(output, 3000)
    assert "rank 0 (node 0) stopped at all_gather #" in output, excerpt(output, 4000)
    # logged as soon as known: the agent's SIGTERM may end rank 0 before its traceback is printed
    assert "fsdp_custom: rank 0 (node 0) sees the other ranks:\n  rank 1 (node 0, host" in output, excerpt(output, 4000)
    assert "fsdp_custom_flight_rank0.json)" in output and "(not written" not in output  # its folder is made
    assert "LOST, its process has exited" in output


@pytest.mark.slow
def test_a_dead_rank_on_another_torchrun_node_is_named(tmp_path):
    args = ["--fault", "kill", "--rank", "3", "--step", "3", "--num-nodes", "2"]
    start = time.time()
    nodes = run_torchrun_nodes(JOB, args, free_port(), tmp_path, timeout=120)
    outputs = [output for _, output in nodes]
    seconds = _seconds_after_fault("".join(outputs), start)
    assert all(code != 0 for code, _ in nodes)
    assert seconds < DEADLINE, excerpt(outputs[0], 3000)
    # node 0's ranks name the lost rank 3 of node 1
    assert "rank 3 (node 1, host" in outputs[0] and "LOST, its process has exited" in outputs[0], excerpt(
        outputs[0], 4000
    )
    assert "rank 0 (node 0) stopped at all_gather #" in outputs[0]


@pytest.mark.parametrize("fault", ["save_kill", "save_kill_all"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, fault):
    checkpoints = str(tmp_path / "checkpoints")
    code, output, seconds = _run("--fault", fault, "--rank", "1", "--step", "4", "--checkpoints", checkpoints)
    assert code != 0 and "FINISHED" not in output
    assert seconds < DEADLINE, excerpt(output, 3000)
    # Lightning's launcher polls its children and SIGKILLs every process once one has died: under load it
    # may end rank 0 before rank 0's watchdog reports (a race the files below do not depend on)
    launcher_first = "Forcefully terminating all other processes" in output and "stopped at" not in output
    if fault == "save_kill" and not launcher_first:
        assert "stopped at all_gather_object #" in output and "rank 1 (node 0" in output, excerpt(output, 4000)
        assert "LOST, its process has exited" in output
    left = sorted(os.listdir(checkpoints))
    assert "last.ckpt" in left and any(name.startswith(".last.ckpt.tmp-") for name in left)
    if fault == "save_kill":  # the same files as after save_kill_all, whose resume follows
        return
    # the step-4 save never committed: "last" is step 3's, the partial one is ignored, then removed
    code, output, _ = _run("--fault", "none", "--resume", "--checkpoints", checkpoints)
    assert code == 0, excerpt(output, 4000)
    assert "STARTED rank 0 at step 3" in output and "FINISHED rank 0 at step 8" in output
    assert sorted(os.listdir(checkpoints)) == ["last.ckpt"]


def test_a_rank_failing_before_a_sharded_save_stops_every_rank_at_once(tmp_path):
    # rank 1 fails preparing its shards while rank 0 would enter DCP's collectives: both agree first
    args = ["--fault", "save_raise", "--rank", "1", "--step", "4", "--checkpoints", str(tmp_path / "ckpt")]
    code, output, seconds = _run(*args)
    assert code != 0 and "FINISHED" not in output
    assert seconds < DEADLINE, excerpt(output, 3000)
    assert "rank 1: OSError: injected failure while preparing the save" in output, excerpt(output, 4000)
    assert "CheckpointSaveError" in output


def test_a_failure_a_script_caught_is_not_reported_again_by_the_next_run():
    # every rank raises in training_step, the script catches it and fits again (rank 1 slow once there)
    code, output, _ = _run("--fault", "caught", "--step", "2")
    assert code == 0, excerpt(output, 4000)
    assert "FINISHED rank 0 at step 8" in output and "FINISHED rank 1 at step 8" in output
    assert "CollectiveError" not in output and "ending this process" not in output


def test_an_async_save_after_training_completes(tmp_path):
    checkpoints = tmp_path / "ckpt"
    checkpoints.mkdir()
    code, output, _ = _run("--fault", "async_after_fit", "--checkpoints", str(checkpoints))
    assert code == 0, excerpt(output, 4000)
    assert sorted(os.listdir(checkpoints)) == ["after.ckpt", "last.ckpt"]
    assert sorted(os.listdir(checkpoints / "after.ckpt"))[-2:] == ["fsdp_meta.json", "meta.pt"]
    assert "terminate called" not in output and "ending this process" not in output


def test_every_rank_raising_and_catching_with_one_rank_slower_ends_well():
    # rank 1 raises at once and reports; rank 0 does 6 s of its own work first, then raises too;
    # both catch the exception and rank 0 post-processes for 8 s: nobody is ended for the other's
    # report, also past collective_timeout (the group's 10 s here): a caught exception leaves no deadline
    code, output, _ = _run("--fault", "caught_slow", "--step", "3", "--pg-timeout", "10", "--post-seconds", "8")
    assert code == 0, excerpt(output, 4000)
    assert "CAUGHT rank 0 stops here at step 3" in output and "CAUGHT rank 1 stops here at step 3" in output
    assert "ending this process" not in output and "CollectiveError" not in output


def test_a_rank0_save_longer_than_a_short_collective_timeout_is_not_a_failure(tmp_path):
    # the other rank waits in a barrier for rank 0's 8 s write: barriers are left to the group's
    # timeout (20 s here, 30 min by default), not to the engine's collective_timeout (3 s)
    checkpoints = tmp_path / "checkpoints"
    args = ["--fault", "slow_save", "--step", "3", "--save-seconds", "8", "--collective-timeout", "3"]
    code, output, _ = _run(*args, "--pg-timeout", "20", "--checkpoints", str(checkpoints))
    assert code == 0, excerpt(output, 4000)
    assert "LIMITS rank 0: collective 3 s, blocking calls 50 s" in output
    assert "FINISHED rank 0 at step 8" in output and os.listdir(checkpoints) == ["last.ckpt"]


def _sigterm_every_rank(strategy: str, checkpoints: Path) -> tuple[int, str]:
    """Run under torchrun, send SIGTERM to both ranks at once while they sleep in a step; return the
    end. (Lightning's SIGTERM handler runs a broadcast: a signal landing while one rank is inside a
    collective can hang DDP as well as any strategy, so the signal is sent inside a 2 s step.)"""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", JOB]
    command += ["--fault", "none", "--step-seconds", "2", "--strategy", strategy]  # both ranks asleep in a step
    command += ["--checkpoints", str(checkpoints), "--on-exception-seconds", "6"]
    job = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        for line in job.stdout:  # both ranks in training (their SIGTERM handlers installed)
            lines.append(line)
            if all(any(f"STARTED rank {rank}" in seen for seen in lines) for rank in (0, 1)):
                break
        time.sleep(1.0)
        for rank in psutil.Process(job.pid).children():
            os.kill(rank.pid, signal.SIGTERM)
        output = "".join(lines) + job.communicate(timeout=90)[0]
    finally:
        job.kill()
    return job.returncode, output


def test_sigterm_to_every_rank_ends_as_lightning_does(tmp_path):
    # every rank raises SIGTERMException at the same batch boundary ([Note: preemption at an agreed
    # step]); OnExceptionCheckpoint saves, then rank 0 spends 6 s in an on_exception of its own (an
    # upload): as under DDP, all end well, but with status 143 (128 + SIGTERM: ended by the signal,
    # where DDP's 0 reads as a finished job), which torchrun reports as the workers' exit code
    reference = _sigterm_every_rank("ddp_find_unused_parameters_true", tmp_path / "ddp")
    code, output = _sigterm_every_rank("fsdp_custom", tmp_path / "fsdp")
    assert reference[0] == 0 and code != 0, excerpt(output, 4000)
    # ended by SIGTERM: 143, or -15 where the agent's own SIGTERM (sent to the workers still running when
    # one exits) lands in the interpreter's last moments, after every handler ran (Python restores the
    # default action there); before that, a SIGTERM after the stop is recorded and ignored
    assert output.count("exitcode  : 143") + output.count("exitcode  : -15") == 2, excerpt(output, 4000)
    assert "fsdp_custom: SIGTERM received by 2 of 2 ranks; every rank stops before this batch" in output
    for rank in (0, 1):
        assert f"ON_EXCEPTION rank {rank}: SIGTERMException" in output, excerpt(output, 4000)
    assert os.listdir(tmp_path / "fsdp") == os.listdir(tmp_path / "ddp") == ["on_exception.ckpt"]
    assert "fsdp_custom: rank" not in output and "ending this process" not in output


def test_a_rank_waiting_in_a_barrier_when_another_raises_fails_there_and_runs_its_handlers():
    # rank 1 raises instead of joining rank 0's barrier: rank 0 is not ended from the watchdog's
    # thread; its barrier fails once rank 1 is gone, and its on_exception runs (as under DDP)
    code, output, seconds = _run("--fault", "barrier_raise", "--rank", "1", "--step", "3")
    assert code != 0 and seconds < DEADLINE, excerpt(output, 4000)
    assert "ON_EXCEPTION rank 0: CollectiveError" in output and "ON_EXCEPTION rank 1: ValueError" in output
    assert "rank 0 (node 0) stopped at barrier #" in output and "rank 1 raised ValueError" in output
    assert "ending this process" not in output


def test_a_rank_that_raises_is_reported_before_its_checkpoint_on_exception(tmp_path):
    # OnExceptionCheckpoint on rank 1 waits in the save's collectives; rank 0, told at once, stops
    # (under DDP, and before the step reported by itself, both waited for the group's timeout)
    args = ["--fault", "raise", "--rank", "1", "--step", "3", "--checkpoints", str(tmp_path / "ckpt")]
    code, output, seconds = _run(*args, "--on-exception-seconds", "0")
    assert code != 0 and seconds < DEADLINE, excerpt(output, 4000)
    assert "First report: rank 1 raised ValueError: injected failure in training_step" in output, excerpt(output, 4000)


def test_a_failed_jobs_excerpt_keeps_its_first_error_and_its_end():
    """Assertion messages show the first error of a job's output, not only its last 3000 characters
    (torchrun's traceback after a rank died filled them, and the rank's own error was lost)."""
    from dist_utils import excerpt

    output = "starting\n" * 500 + "Traceback (most recent call last):\nValueError: the cause\n" + "agent noise\n" * 800
    shown = excerpt(output, 3000)
    assert "ValueError: the cause" in shown and shown.endswith("agent noise\n") and len(shown) < 3200, shown
    assert excerpt("short", 3000) == "short"
    late = "x\n" * 3000 + "RuntimeError: at the end\n"
    assert excerpt(late, 3000) == late[-3000:]
