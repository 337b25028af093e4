"""The soak benchmark's short version (benchmarks/soak.py --steps 200 --repeat-steps 40 --small): nothing
the run keeps grows after warm-up but memory within bounds, and a repeated and a resumed run give
bitwise the weights the first had at step 40 (same LR schedule)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import excerpt

from fsdp_strategy.engine.flight import RING_SIZE

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_200_steps_of_the_gpt_example_leak_nothing_and_repeat_bitwise(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}
    steps = ["--steps", "200", "--repeat-steps", "40", "--every", "20", "--small"]
    command = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), *steps, "--root", str(tmp_path)]
    log = tmp_path / "soak.log"
    with log.open("w") as output:  # a file, not a pipe: W&B's service process outlives the job holding it
        job = subprocess.run(command, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert job.returncode == 0, excerpt(text, 4000)
    report = json.loads(next(line for line in text.splitlines() if line.startswith("SOAK "))[5:])
    assert report["repeat_steps"] == 40 and report["hash_first"]
    assert report["hash_first"] == report["hash_again"] == report["hash_resumed"]
    after = [sample for sample in report["samples"] if sample["step"] >= report["warmup"]]
    for key in ("threads", "fds", "ledger_units", "memory_timeline", "monitor_entries"):
        assert len({sample[key] for sample in after}) == 1, (key, after)
    assert all(sample["flight_ring"] <= RING_SIZE for sample in after)
    assert report["growth"]["rss_mib"] < 0.02  # the 2,000-step run in docs/troubleshooting.md: within 1 %
