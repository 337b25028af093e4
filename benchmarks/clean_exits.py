"""Correct 2-rank jobs in a row must all exit 0, with no abort at interpreter exit.

    python benchmarks/clean_exits.py --jobs 50      # the figure in docs/troubleshooting.md: 50 under each launcher
    python benchmarks/clean_exits.py --jobs 1       # the CI version (tests/test_clean_exit.py)

Each job is tests/faulty_job.py without a fault (8 steps of a tiny LM, gloo, 2 ranks; every
other job builds the model on the meta device, the first under torchrun), run under Lightning's own launcher
(``python job.py``) and under torchrun. A job fails if any process exits non-zero or prints
"terminate called" (a C++ abort at exit, which a scheduler counts as a failure). Prints one
JSON line ``CLEAN_EXITS {...}`` with the counts per launcher and the first failure's output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "tests" / "faulty_job.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_job(launcher: str, meta_init: bool, port: int) -> tuple[int, str]:
    """One job's return code and output."""
    args = ["--fault", "none", *(["--meta-init"] if meta_init else [])]
    command = [sys.executable, JOB, *args]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
        command += [JOB, *args]
    job = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    return job.returncode, job.stdout + job.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=50, help="jobs per launcher")
    args = parser.parse_args()
    summary = {}
    for launcher_index, launcher in enumerate(("lightning", "torchrun")):
        start = time.monotonic()
        failures = []
        for index in range(args.jobs):
            code, output = run_job(launcher, meta_init=(index + launcher_index) % 2 == 1, port=29700 + index % 50)
            finished = output.count("FINISHED rank")
            if code != 0 or "terminate called" in output or finished != 2:
                failures.append({"job": index, "code": code, "output": output[-3000:]})
        summary[launcher] = {
            "jobs": args.jobs,
            "failed": len(failures),
            "seconds": round(time.monotonic() - start, 1),
            "first_failure": failures[0] if failures else None,
        }
    print("CLEAN_EXITS " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
