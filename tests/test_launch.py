"""The real launch paths, end to end: ``python script.py`` (Lightning spawns the second rank),
``torchrun``, and resuming from the last checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
SMALL = [
    "data.max_bytes=200000",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.seq_len=32",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
]


def _run(command: list[str], timeout: float = 240) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
def test_python_script_launch_and_resume(tmp_path):
    args = [*SMALL, f"trainer.default_root_dir={tmp_path}"]
    first = _run([sys.executable, str(EXAMPLE), "trainer.max_steps=4", *args])
    assert "done: 4 steps" in first and "FULL_SHARD over 2 ranks" in first
    assert (tmp_path / "checkpoints" / "last.ckpt" / "fsdp_meta.json").is_file()  # a sharded folder
    resumed = _run([sys.executable, str(EXAMPLE), "trainer.max_steps=6", "resume=last", *args])
    assert "Restored all states" in resumed and "done: 6 steps" in resumed


@pytest.mark.slow
def test_torchrun_launch(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533"]
    output = _run([*command, str(EXAMPLE), "trainer.max_steps=3", *SMALL, f"trainer.default_root_dir={tmp_path}"])
    assert "done: 3 steps" in output and "over 2 ranks" in output
