"""Time from SIGTERM to exit of a preempted job, per phase and launcher: every process of a
2-rank job (Lightning's launcher, or torchrun's agent and its workers) gets SIGTERM at a random
moment inside a phase that lasts ``--seconds`` ([Note: preemption at an agreed step] in
fsdp_strategy/strategy_preemption.py; the job is tests/preempt_job.py).

    python benchmarks/preemption.py                       # every phase, both launchers, 5 trials each
    python benchmarks/preemption.py --phases step validation --launchers torchrun --trials 2

Prints a Markdown table: the median and the slowest time to the last process's exit (it includes
the rest of the phase in flight and the checkpoint saved on the way out), and the trials that
did not end with every rank stopping at one boundary (a collective error, a watchdog report, a
process still running 90 s later, or no checkpoint).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dist_utils import free_port  # noqa: E402
from preempt_job import PHASES, preempt  # noqa: E402


def trial(launcher: str, phase: str, seconds: float) -> tuple[float, str]:
    """One preemption: its time to exit and what went wrong ("" if nothing)."""
    with tempfile.TemporaryDirectory() as folder:
        checkpoints = Path(folder) / "checkpoints"
        try:
            ended = preempt(launcher, phase, random.uniform(0.0, seconds * 0.8), checkpoints, free_port())
        except (RuntimeError, AssertionError) as error:
            return float("nan"), str(error).splitlines()[0]
        problems = [
            word for word in ("CollectiveError", "ending this process", "fsdp_custom: rank") if word in ended.output
        ]
        if ended.output.count("fsdp_custom: SIGTERM received by 2 of 2 ranks") != 1:
            problems.append("no agreed stop")
        if not any(path.name.endswith(".ckpt") for path in checkpoints.iterdir()):
            problems.append("no checkpoint")
        return ended.seconds, ", ".join(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    parser.add_argument("--launchers", nargs="+", default=["lightning", "torchrun"], choices=["lightning", "torchrun"])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.5, help="how long each phase lasts")
    args = parser.parse_args()
    print("| launcher | phase | median s | slowest s | failed trials |")
    print("|---|---|---|---|---|")
    for launcher in args.launchers:
        for phase in args.phases:
            results = [trial(launcher, phase, args.seconds) for _ in range(args.trials)]
            times = [seconds for seconds, problem in results if not problem]
            failed = [problem for _, problem in results if problem]
            median = f"{statistics.median(times):.1f}" if times else "-"
            slowest = f"{max(times):.1f}" if times else "-"
            print(f"| {launcher} | {phase} | {median} | {slowest} | {len(failed)} {'; '.join(failed)} |", flush=True)


if __name__ == "__main__":
    main()
