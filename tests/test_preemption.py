"""Preemption as clusters do it: SIGTERM to every process of a real job (Lightning's launcher, or
torchrun's agent and its workers), at a random moment inside a training step, a validation batch
and a background checkpoint write. Every rank stops at one boundary within seconds of the phase
in flight, saves the last step and exits 143 ([Note: preemption at an agreed step]), with no
collective error, no watchdog report and no half checkpoint. Resumed exactly: test_resume_stops.py;
every phase, 5 trials each, timed: benchmarks/preemption.py."""

from __future__ import annotations

import random

import pytest
from dist_utils import free_port
from preempt_job import preempt

PHASE_SECONDS = 1.5
CASES = [("lightning", "step"), ("torchrun", "validation"), ("lightning", "async_save")]


@pytest.mark.parametrize(("launcher", "phase"), CASES)
def test_sigterm_to_every_process_stops_every_rank_at_one_boundary_and_saves(tmp_path, launcher, phase):
    delay = random.uniform(0.0, PHASE_SECONDS - 0.3)
    checkpoints = tmp_path / "checkpoints"
    ended = preempt(launcher, phase, delay, checkpoints, free_port())
    where = f"{launcher}, {phase}, SIGTERM {delay:.2f} s into it:\n{ended.output[-3000:]}"
    assert ended.seconds < PHASE_SECONDS + 10, (ended.seconds, where)
    # torchrun's agent, signalled too, exits 1 with its own SignalException; Lightning's rank 0 exits 143
    assert ended.codes[0] == (1 if launcher == "torchrun" else 143), (ended.codes, where)
    assert ended.output.count("fsdp_custom: SIGTERM received by 2 of 2 ranks") == 1, where
    for failure in ("CollectiveError", "ending this process", "fsdp_custom: rank", "FINISHED"):
        assert failure not in ended.output, (failure, where)
    saved = sorted(path.name for path in checkpoints.iterdir())
    assert "last.ckpt" in saved and all(name.endswith(".ckpt") for name in saved), (saved, where)  # none half-written
