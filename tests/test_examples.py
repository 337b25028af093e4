"""The examples, run as a user runs them, briefly: the GPT script through the real launch paths
(``python script.py``, where Lightning spawns the second rank, and ``torchrun``) and its resume,
the LightningCLI example, and the memory plot."""

from __future__ import annotations

import importlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from dist_utils import excerpt, free_port

from fsdp_strategy.callbacks.wandb_history import history
from fsdp_strategy.callbacks.wandb_history import main as read_history

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


def _run(command: list[str], timeout: float = 240, expect: int = 0) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == expect, excerpt(output, 4000)
    return output


def _main_exits_2(script: Path, argv: list[str], monkeypatch, capsys) -> str:
    """Run ``script``'s ``main(argv)`` in this process (the same code as a launch, after its
    imports; for mistakes that end it before anything starts): it must exit with status 2; what
    it printed."""
    monkeypatch.syspath_prepend(str(script.parent))
    monkeypatch.setattr(sys, "argv", [str(script)])
    module = importlib.import_module(script.stem)
    with pytest.raises(SystemExit) as exited:
        module.main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    return captured.out + captured.err


def test_the_continue_command_is_the_script_as_run_and_pastes_into_a_shell(monkeypatch):
    """The hint names the script as it was invoked (from another folder too) and quotes what the shell
    would split: the shell's own parsing of the hint gives back the overrides."""
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    example_config = importlib.import_module("example_config")
    monkeypatch.setattr(sys, "argv", ["../my runs/train_gpt.py"])
    argv = ["logger.name=first try", "--trainer.devices", "1", "resume=last", "trainer.max_steps=4"]
    command = example_config.continue_command(argv, "last", "trainer.max_steps", 8)
    expected = ["python", "../my runs/train_gpt.py", "resume=last", "trainer.max_steps=8"]
    assert shlex.split(command) == [*expected, "logger.name=first try", "trainer.devices=1"], command


def _run_ids(wandb_dir: Path) -> list[str]:
    return [run.name.rsplit("-", 1)[-1] for run in sorted(wandb_dir.glob("offline-run-*"))]


@pytest.mark.slow
def test_python_script_launch_repeat_and_resume(tmp_path, capsys, monkeypatch):
    args = [*SMALL, f"trainer.default_root_dir={tmp_path}"]
    _run([sys.executable, str(EXAMPLE), "trainer.max_steps=2", *args])
    first = _run([sys.executable, str(EXAMPLE), "--trainer.max_steps=4", *args])  # a new run, same folder
    assert "done: 4 steps" in first and "FULL_SHARD over 2 ranks" in first
    assert f"train further with: python {EXAMPLE} resume=last trainer.max_steps=8" in first  # the script as run
    assert "W&B run:" in first and "wandb sync" in first
    assert "wandb:" not in first  # an offline run: nothing from W&B the user did not ask for
    rows = history(tmp_path / "wandb")
    assert any("memory/sharded_params/max" in row for row in rows)
    assert any("comm/all_gather/calls" in row for row in rows)
    reader = [sys.executable, "-m", "fsdp_strategy.callbacks.wandb_history", str(tmp_path / "wandb")]
    csv_rows = _run([*reader, "comm/all_gather/calls"]).splitlines()  # README's command, launched once
    assert read_history([str(tmp_path / "wandb"), "val_los"]) == 2
    unknown = capsys.readouterr().err
    assert "did you mean 'val_loss'?\nlogged keys:\n" in unknown and max(map(len, unknown.splitlines())) <= 160
    assert csv_rows[0] == "trainer/global_step,comm/all_gather/calls" and csv_rows[1:] == [
        f"{step},{row['comm/all_gather/calls']}"
        for step, row in enumerate(r for r in rows if "comm/all_gather/calls" in r)
    ]
    checkpoints = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert "last.ckpt" in checkpoints and not any(name.startswith("last-v") for name in checkpoints), checkpoints
    assert (tmp_path / "checkpoints" / "last.ckpt" / "fsdp_meta.json").is_file()  # a sharded folder
    # the checkpoint names its W&B run, so even an interrupted run's checkpoint resumes into its run
    saved_by = torch.load(tmp_path / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=False)
    with_bar = [arg for arg in args if not arg.startswith("trainer.enable_progress_bar")]
    resumed = _run([sys.executable, str(EXAMPLE), "trainer.max_steps=6", "resume=last", *with_bar])
    assert "Restored all states" in resumed and "done: 6 steps" in resumed
    assert "not resumable" not in resumed.replace("the dataloader is not resumable does not apply", "")
    bar = [part.split("|")[2].split()[0] for part in resumed.replace("\r", "\n").splitlines() if "Epoch 0:" in part]
    assert bar and set(bar) <= {"4/6", "5/6", "6/6"} and "6/6" in bar, bar  # resumed at batch 4, ends at 6
    ids = _run_ids(tmp_path / "wandb")
    assert len(ids) == 3 and ids[2] == ids[1] != ids[0] and saved_by["wandb_run_id"] == ids[1]
    # the W&B folder reads as the resumed run's two parts in order; a run folder reads as itself
    steps = [row["trainer/global_step"] for row in history(tmp_path / "wandb") if "comm/all_gather/calls" in row]
    newest = sorted((tmp_path / "wandb").glob("offline-run-*"))[-1]
    assert steps == [0, 1, 2, 3, 4, 5] and [row["trainer/global_step"] for row in history(newest)][-1] == 5, steps
    assert all(row["trainer/global_step"] >= 4 for row in history(newest))
    finished = _main_exits_2(EXAMPLE, ["trainer.max_steps=6", "resume=last", *args], monkeypatch, capsys)
    assert "is at step 6 and trainer.max_steps=6: nothing to train" in finished
    assert f"python {EXAMPLE} resume=last trainer.max_steps=12 {' '.join(args)}" in finished  # overrides repeated
    assert len(_run_ids(tmp_path / "wandb")) == 3  # no empty W&B run


def test_example_config_mistakes_are_errors_that_list_what_is_accepted(tmp_path, monkeypatch, capsys):
    helped = _run([sys.executable, str(EXAMPLE), "--help"], timeout=120)  # as a user runs it
    assert "trainer.max_steps" in helped and "max_steps: 150" in helped and "``" not in helped
    typo = _run([sys.executable, str(EXAMPLE), "trainer.max_stepz=5"], expect=2, timeout=120)
    assert "unknown key 'trainer.max_stepz'; did you mean 'trainer.max_steps'" in typo and "Traceback" not in typo
    assert max(map(len, typo.splitlines())) <= 120  # the accepted keys wrapped, not one 900-character line

    # the other mistakes through the script's main in this process (the same code after the imports)
    def run(*args: str) -> str:
        return _main_exits_2(EXAMPLE, list(args), monkeypatch, capsys)

    keys = "name, lr, weight_decay, warmup_steps, muon_lr"
    assert f"did you mean 'optimizer.lr'?\naccepted keys of optimizer:\n  {keys}" in run("optimizer.lrr=0.1")
    assert "unknown key 'max_steps'; did you mean 'trainer.max_steps'?" in run("max_steps=3")  # its section left out
    assert "no checkpoint at" in run("resume=last", f"trainer.default_root_dir={tmp_path}")
    assert "resume=1: no checkpoint at 1;" in run("resume=1", f"trainer.default_root_dir={tmp_path}")
    # values each part refuses end the script with that part's message, before anything starts
    for override, told in {
        "trainer.max_steps=null": "trainer.max_steps=None: this script needs a positive number of steps",
        "strategy.sharding_strategy=FULL_SHRAD": (
            "strategy: sharding_strategy='FULL_SHRAD' is not supported (did you mean 'FULL_SHARD'?); accepted"
        ),
        "strategy.cpu_offload=maybe": "strategy: cpu_offload must be a bool, a CPUOffload, a dict or None",
        "model.n_heads=3": "model: d_model=128 is not divisible by n_heads=3",
        "optimizer.name=sgd": "optimizer: name='sgd': accepted: ['adamw', 'muon']",
        "trainer.devices=0": "trainer: `Trainer(devices=0)` value is not a valid input",
    }.items():
        output = run(override, f"trainer.default_root_dir={tmp_path}")
        assert f"train_gpt.py: error: {told}" in output and "Traceback" not in output, output
    assert not (tmp_path / "wandb").exists()


def test_example_config_accepts_every_documented_form():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import example_config
        import lightning as L

        from fsdp_strategy import FSDPCustomStrategy

        sections = {"trainer": (L.Trainer, {"strategy"}), "strategy": (FSDPCustomStrategy, set())}
        default = ROOT / "examples" / "configs" / "gpt_small.yaml"
        forms = [["trainer.max_steps=5"], ["--trainer.max_steps=5"], ["--trainer.max_steps", "5"]]
        for argv in forms:
            assert example_config.load(argv, default, sections).trainer.max_steps == 5, argv
        extra = example_config.load(
            ["trainer.accumulate_grad_batches=2", "strategy.cpu_offload=true"], default, sections
        )
        assert extra.trainer.accumulate_grad_batches == 2 and extra.strategy.cpu_offload is True
        loose = example_config.load(["optimizer.lr=1", "trainer.devices=auto"], default, sections)
        assert loose.optimizer.lr == 1 and loose.trainer.devices == "auto"
        # the FSDP keywords Lightning's FSDPStrategy passes through **kwargs; the strategy checks their values
        passed = example_config.load(
            ["strategy.use_orig_params=true", "strategy.limit_all_gathers=true"], default, sections
        )
        assert passed.strategy.use_orig_params is True and passed.strategy.limit_all_gathers is True
        with pytest.raises(ValueError, match="use_orig_params=False has no meaning"):
            FSDPCustomStrategy(**{"use_orig_params": False})
        mistakes = {
            "trainer.strategy=ddp": "cannot be set here",
            "strategy.fsdp_kwargs=1": "unknown key.*strategy.fsdp_kwargs",  # the name of **kwargs is no key
            "--monitors.log_every=5": "accepted keys of monitors:\n  log_every_n_steps",
            "strategy.shard=1": "strategy.shard.*sharding_strategy",
            "--trainer.max_steps": "needs a value",
            "max_steps": "overrides are key=value",
            "model=3": "model is a section",
            "strategy=fsdp_custom": "strategy is a section",
            "trainer=3": "trainer is a section",
            "seed=abc": r"seed='abc': expected int",
            "model.d_model=abc": r"model.d_model='abc': expected int",
            "optimizer.lr=abc": r"optimizer.lr='abc': expected float",
            "logger.offline=maybe": r"logger.offline='maybe': expected bool",
            "trainer.max_steps=abc": r"trainer.max_steps='abc': expected int \(the type of Trainer's max_steps\)",
            "trainer.gradient_clip_val=x": r"trainer.gradient_clip_val='x': expected Union\[int, float, NoneType\]",
            "strategy.state_dict_type=shardd": (
                r"strategy.state_dict_type='shardd': expected Literal\['full', 'sharded'\]"
            ),
        }
        for arg, message in mistakes.items():
            with pytest.raises(example_config.ConfigError, match=message):
                example_config.load(arg.split(), default, sections)
    finally:
        sys.path.remove(str(ROOT / "examples"))


def _rank_pid(agent_pid: int, local_rank: int) -> int | None:
    """The pid of torchrun's worker ``local_rank`` of the agent ``agent_pid``, once it runs."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            parent = int((environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[1])
            variables = environ.read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if parent == agent_pid and f"LOCAL_RANK={local_rank}".encode() in variables:
            return int(environ.parent.name)
    return None


@pytest.mark.slow
def test_torchrun_restart_resumes(tmp_path):
    """docs/restarts.md's torchrun command with ``resume=auto`` (and Muon, README's quick start): rank 1 is
    SIGKILLed once the first checkpoint is committed; torchrun restarts both ranks on its shared
    store and the run resumes from ``last`` and finishes, training again within 30 s of the kill."""
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    args = [*SMALL, "optimizer.name=muon", "resume=auto", "trainer.max_steps=40", "trainer.val_check_interval=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agent = subprocess.Popen(
        [*command, *rendezvous, str(EXAMPLE), *args, f"trainer.default_root_dir={tmp_path}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in agent.stdout))
    reader.start()
    try:
        committed = tmp_path / "checkpoints" / "last.ckpt" / "meta.pt"
        deadline = time.monotonic() + 180
        while not committed.exists() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rank1 = _rank_pid(agent.pid, 1)
        assert rank1 is not None, excerpt("".join(line for _, line in lines), 4000)
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        agent.wait(timeout=240)
    finally:
        agent.kill()
        reader.join(timeout=10)
    output = "".join(line for _, line in lines)
    assert agent.returncode == 0, excerpt(output, 4000)
    restored = [at for at, line in lines if "Restored all states from the checkpoint" in line and at > killed]
    assert restored and restored[0] - killed < 30, excerpt(output, 4000)
    print(f"killed rank 1; restored {restored[0] - killed:.1f} s later")
    assert "done: 40 steps" in output and "over 2 ranks" in output


@pytest.mark.slow
def test_lightning_cli_example(tmp_path):
    command = [
        sys.executable,
        str(ROOT / "examples" / "cli.py"),
        "fit",
        "--config",
        str(ROOT / "examples" / "configs" / "cli.yaml"),
    ]
    overrides = [
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--data.max_bytes=100000",
    ]
    changed = _run([*command, *overrides, "--trainer.strategy.init_args.sharding_strategy=SHARD_GRAD_OP"])
    # the strategy built from the YAML with README's form of an override, which keeps the YAML's wrap policy
    assert "SHARD_GRAD_OP over 2 ranks, 5 units" in changed
    assert "wandb:" not in changed, excerpt(changed, 3000)  # an offline run is quiet, as in train_gpt.py


def test_lightning_cli_mistakes_come_first_and_alone(tmp_path):
    command = [
        sys.executable,
        str(ROOT / "examples" / "cli.py"),
        "fit",
        "--config",
        str(ROOT / "examples" / "configs" / "cli.yaml"),
    ]
    where = [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    typo = _run([*command, *where, "--trainer.strategy.init_args.auto_wrap_policy=[gpt.Blok]"], expect=1)
    lines = [line for line in typo.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert lines == [
        "cli.py: error: auto_wrap_policy='gpt.Blok': cannot import it (module 'gpt' has no attribute 'Blok'); "
        "give a dotted path like 'mypackage.model.Block'"
    ], typo
    typo_inside = _run([*command, *where, "--model.model={d_modle: 3}"], expect=2)
    assert "does not accept option 'model.model.d_modle'" in typo_inside


@pytest.mark.slow
def test_plot_memory_example(tmp_path):
    out = tmp_path / "memory.png"
    script = ROOT / "examples" / "plot_memory.py"
    output = _run([sys.executable, str(script), "--out", str(out), "--d-model", "32", "--n-layers", "2"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "gathered peak" in output


FABRIC_EXAMPLE = ROOT / "examples" / "fabric_gpt.py"
FABRIC_SMALL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.seq_len=32",
    "data.max_bytes=100000",
    "train.log_every_n_steps=1",
    "train.save_every_n_steps=2",
]


def test_fabric_example_trains_saves_and_resumes_on_another_world_size(tmp_path, capsys, monkeypatch):
    args = [*FABRIC_SMALL, f"train.out_dir={tmp_path}"]
    first = _run([sys.executable, str(FABRIC_EXAMPLE), "train.max_steps=4", *args])
    assert "done: 4 steps" in first and (tmp_path / "last.ckpt" / "fsdp_meta.json").is_file()
    resumed = _run([sys.executable, str(FABRIC_EXAMPLE), "resume=last", "train.max_steps=6", "fabric.devices=1", *args])
    assert "resumed from" in resumed and "at step 4 on 1 rank\n" in resumed and "done: 6 steps" in resumed
    further = f"train further with: python {FABRIC_EXAMPLE} resume=last train.max_steps=12 fabric.devices=1"
    assert further in resumed
    assert len({run.name.rsplit("-", 1)[-1] for run in (tmp_path / "wandb").glob("offline-run-*")}) == 1  # one run
    rows = history(tmp_path / "wandb")
    losses = [row["trainer/global_step"] for row in rows if "train_loss" in row]
    assert losses == [0, 1, 2, 3, 4, 5], losses
    two_ranks = [row for row in rows if "comm/all_gather/calls" in row]  # the monitors, from the Fabric loop
    assert [row["trainer/global_step"] for row in two_ranks] == [0, 1, 2, 3]
    assert all(row["memory/sharded_params/max"] > 0 for row in rows if "memory/sharded_params/max" in row)
    finished = _main_exits_2(FABRIC_EXAMPLE, ["resume=last", "train.max_steps=6", *args], monkeypatch, capsys)
    assert "is at step 6 and train.max_steps=6: nothing to train" in finished


def test_tensor_parallel_example_trains_as_one_process():
    """Lightning's tensor-parallel example on fsdp_custom, launched as a user launches it (Lightning
    spawns the second rank): 1 data-parallel x 2 tensor-parallel, the MLPs split and the rest whole,
    its losses against the same model and batches in one process."""
    output = _run([sys.executable, str(ROOT / "examples" / "tensor_parallel.py"), "--steps", "3", "--compare"])
    assert "(1 data-parallel x 2 tensor-parallel)" in output, excerpt(output, 2000)
    assert "mesh {'data_parallel': 1, 'tensor_parallel': 2}" in output, excerpt(output, 2000)
    difference = float(output.split("largest relative difference: ")[1].split()[0])
    assert difference < 1e-5, excerpt(output, 2000)
