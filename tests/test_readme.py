"""README's quick start shows what the example prints and what its W&B run holds: run the example
exactly as README says (150 steps, about 70 s on 2 CPU cores) and compare every figure README
quotes from it, to within one unit of its last quoted digit, 0.001 or 0.1 % (the sums of another
machine's CPU and thread count move the fourth digit of a perplexity: 19.3452 on one machine,
19.3357 on another). When the example's numbers change, this test names each figure to update.
Then the "train further with" line the example printed resumes where the run stopped."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import excerpt

from fsdp_strategy.callbacks.wandb_history import history

ROOT = Path(__file__).resolve().parents[1]


def _quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Quick start")
    return readme[start : readme.index("\n## ", start + 1)]


def _at(rows: list[dict], key: str, step: int) -> float:
    values = [row[key] for row in rows if key in row and row.get("trainer/global_step") == step]
    assert values, f"the run logged no {key} at step {step}"
    return values[-1]


@pytest.mark.slow
def test_readme_quick_start_figures_are_what_the_example_prints(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}  # as in a shell
    text = _quick_start()
    (line,) = [line for line in text.splitlines() if line.startswith("python examples/train_gpt.py")]
    _python, script, *args = line.split()  # README.md's command, run from the checkout's root
    command = [sys.executable, str(ROOT / script), *args, f"trainer.default_root_dir={tmp_path}"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)  # as README
    assert done.returncode == 0, excerpt(done.stdout + done.stderr, 4000)
    assert "wandb:" not in done.stdout + done.stderr  # nothing from W&B the user did not ask for
    # README's reader of the run, from the checkout's root (where the source tree's fsdp_strategy is imported)
    (reader,) = [line for line in text.splitlines() if line.startswith("python -m fsdp_strategy.callbacks")]
    reader = reader.replace("runs/gpt_small/wandb", str(tmp_path / "wandb")).split()
    read = subprocess.run([sys.executable, *reader[1:]], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0 and read.stdout.startswith("trainer/global_step,train_loss,val_loss"), read.stderr
    printed = re.search(r"^done: .*$", done.stdout, re.MULTILINE).group(0)
    quoted = re.search(r"^done: .*$", text, re.MULTILINE).group(0)
    pairs = [  # (figure, as README quotes it, as the run logged it)
        (f"final {name}", f"{value}", ast.literal_eval(printed.split("metrics ")[1])[name])
        for name, value in ast.literal_eval(quoted.split("metrics ")[1]).items()
    ]
    figures = " ".join(text[text.index("The loss falls visibly") : text.index("Read them without")].split())
    rows = history(tmp_path / "wandb")
    losses = re.search(
        r"train loss (\S+) at step (\d+), (\S+) at step (\d+), (\S+) at step (\d+); "
        r"validation loss (\S+) at step (\d+), (\S+) at step (\d+)\.",
        figures,
    ).groups()
    for name, values in (("train_loss", losses[:6]), ("val_loss", losses[6:])):
        pairs += [
            (f"{name} at step {step}", value, _at(rows, name, int(step))) for value, step in zip(*[iter(values)] * 2)
        ]
    monitors = re.search(
        r"per rank (\S+) MiB of sharded parameters .*?, (\S+) MiB of optimizer state, (\S+) MiB of gathered "
        r".* per step (\d+) all-gathers \((\S+) MiB sent per rank\) and (\d+) reduce-scatters",
        figures,
    ).groups()
    last = max(row["trainer/global_step"] for row in rows if "memory/sharded_params/max" in row)
    names = (
        "memory/sharded_params/max",
        "memory/optimizer_state/max",
        "memory/gathered_peak/max",
        "comm/all_gather/calls",
        "comm/all_gather/wire_mib",
        "comm/reduce_scatter/calls",
    )
    pairs += [(name, value, _at(rows, name, last)) for name, value in zip(names, monitors)]
    wrong = [
        f"{name}: README {value}, run {run:.4g}"
        for name, value, run in pairs
        if abs(float(value) - run) > max(10.0 ** -len(value.partition(".")[2]), 1e-3, 1e-3 * abs(run))
    ]
    assert not wrong, f"update README's quick start to the run's figures: {wrong}; the run printed {printed!r}"
    # the "train further with" line it printed, run as printed (10 steps further instead of 150: time)
    further = re.search(r"^train further with: (.*)$", done.stdout, re.MULTILINE).group(1).split()
    assert further[0] == "python" and further[1].endswith("examples/train_gpt.py"), further
    assert "trainer.max_steps=300" in further, further
    further = [sys.executable, *further[1:]]
    further[further.index("trainer.max_steps=300")] = "trainer.max_steps=160"
    resumed = subprocess.run(further, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, excerpt(resumed.stdout + resumed.stderr, 4000)
    output = resumed.stdout + resumed.stderr
    # 150 steps of 16 samples (2 ranks x 8) into the first epoch: where it stopped, not the next epoch's start
    assert "resuming epoch 0 after its first 2400 samples, exactly where the checkpoint left it" in output, output
    assert re.search(r"^done: 160 steps", resumed.stdout, re.MULTILINE), excerpt(resumed.stdout, 2000)
    assert "exists and is not empty" not in output  # the directory holds what it resumes from: no warning


@pytest.mark.slow
def test_quiet_console_snippet_hides_lightnings_tips_on_every_rank(tmp_path):
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    section = guide[guide.index("**A quiet console in your own script.**") :]
    snippet = section[section.index("```python\n") + len("```python\n") : section.index("```\n", 10)]
    script = tmp_path / "train.py"
    script.write_text(
        snippet
        + "import lightning as L\n"
        + "from lightning.pytorch.demos.boring_classes import BoringModel\n\n"
        + "import fsdp_strategy  # noqa: F401\n\n"
        + "L.Trainer(strategy='fsdp_custom', accelerator='cpu', devices=2, max_steps=2, enable_progress_bar=False,\n"
        + f"          default_root_dir={str(tmp_path)!r}).fit(BoringModel())\n"
    )
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "FULL_SHARD over 2 ranks" in output, excerpt(output, 4000)
    assert "litlogger" not in output and "litmodels" not in output and "LeafSpec" not in output, output
