"""Correct 2-rank jobs exit 0 with no abort at interpreter exit, under Lightning's launcher and
torchrun ([Note: watchdog]: the thread is stopped and joined before the process group goes).

A scaled-down run of benchmarks/clean_exits.py (docs/troubleshooting.md: 50 jobs under each launcher)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import excerpt

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_correct_job_under_each_launcher_exits_0_without_an_abort():
    command = [sys.executable, str(ROOT / "benchmarks" / "clean_exits.py"), "--jobs", "1"]
    job = subprocess.run(command, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, excerpt(job.stderr, 3000)
    line = next(line for line in job.stdout.splitlines() if line.startswith("CLEAN_EXITS "))
    summary = json.loads(line.removeprefix("CLEAN_EXITS "))
    for launcher in ("lightning", "torchrun"):
        assert summary[launcher]["jobs"] == 1
        assert summary[launcher]["failed"] == 0, summary[launcher]["first_failure"]
