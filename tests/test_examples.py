"""The examples, run as a user runs them, briefly: the GPT script through the real launch paths
(``python script.py``, where Lightning spawns the second rank, and ``torchrun``) and its resume,
the LightningCLI example, and the memory plot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from wandb_offline import history

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
    "monitors.log_every_n_steps=1",
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
    assert "W&B run:" in first and "wandb sync" in first
    rows = history(tmp_path / "wandb")
    assert any("memory/sharded_params/max" in row for row in rows)
    assert any("comm/all_gather/calls" in row for row in rows)
    assert (tmp_path / "checkpoints" / "last.ckpt" / "fsdp_meta.json").is_file()  # a sharded folder
    resumed = _run([sys.executable, str(EXAMPLE), "trainer.max_steps=6", "resume=last", *args])
    assert "Restored all states" in resumed and "done: 6 steps" in resumed


@pytest.mark.slow
def test_torchrun_launch(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533"]
    output = _run([*command, str(EXAMPLE), "trainer.max_steps=3", *SMALL, f"trainer.default_root_dir={tmp_path}"])
    assert "done: 3 steps" in output and "over 2 ranks" in output


@pytest.mark.slow
def test_lightning_cli_example(tmp_path):
    command = [sys.executable, str(ROOT / "examples" / "cli.py"), "fit", "--config", "examples/configs/cli.yaml"]
    overrides = [
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--data.max_bytes=100000",
    ]
    output = _run([*command, *overrides])
    assert "FULL_SHARD over 2 ranks" in output and "max_steps=2" in output  # strategy built from the YAML
    by_name = _run([*command, *overrides, "--trainer.strategy=fsdp_custom_shard_grad_op"])
    assert "SHARD_GRAD_OP over 2 ranks" in by_name


@pytest.mark.slow
def test_plot_memory_example(tmp_path):
    out = tmp_path / "memory.png"
    script = ROOT / "examples" / "plot_memory.py"
    output = _run([sys.executable, str(script), "--out", str(out), "--d-model", "32", "--n-layers", "2"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "gathered peak" in output
