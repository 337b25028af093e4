"""A Lightning job to preempt, for tests/test_preemption.py and benchmarks/preemption.py.

    python tests/preempt_job.py --phase step --checkpoints DIR                  # Lightning's launcher, 2 ranks
    torchrun --nproc_per_node=2 tests/preempt_job.py --phase validation ...      # torchrun

Each rank prints ``PHASE <phase> rank <r> step <n>`` as it enters the phase, which then lasts
``--seconds`` (a signal sent after the marker lands inside it): ``step`` (a training step),
``accumulation`` (the first of two micro-batches), ``validation`` (a validation batch),
``save`` (the write of a periodic checkpoint), ``async_save`` (a background write of one, with
``async_save=True``), ``epoch_end`` (``on_train_epoch_end``) and ``first_step`` (the first step of
the run). ``ModelCheckpoint(save_on_exception=True)`` saves ``last.ckpt`` every 2 steps and on the
exception a SIGTERM raises.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import lightning as L
import psutil
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy

PHASES = ("step", "accumulation", "validation", "save", "async_save", "epoch_end", "first_step")


class Preempted(L.LightningModule):
    """A small MLP whose chosen phase lasts ``seconds`` each time it comes."""

    def __init__(self, phase: str, seconds: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.phase, self.seconds = phase, seconds

    def enter(self, phase: str) -> None:
        """Mark the phase and let it last."""
        if phase == self.phase:
            print(f"PHASE {phase} rank {self.global_rank} step {self.trainer.global_step}", flush=True)
            time.sleep(self.seconds)

    def training_step(self, batch, batch_idx):
        if self.phase == "step" or (self.phase == "first_step" and self.trainer.global_step == 0):
            self.enter(self.phase)
        if self.phase == "accumulation" and batch_idx % 2 == 0:
            self.enter("accumulation")
        return self.net(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        self.enter("validation")
        self.log("val_loss", self.net(batch[0]).square().mean(), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        self.enter("epoch_end")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SlowWrite(L.Callback):
    """The write of each periodic checkpoint lasts the phase's seconds: its shards (``save``), or the
    end of its background write (``async_save``)."""

    def __init__(self, module: Preempted) -> None:
        self.module = module

    def setup(self, trainer, pl_module, stage) -> None:
        import fsdp_strategy.checkpoint.sharded as sharded

        name = {"save": "write_dcp", "async_save": "finish_folder"}.get(self.module.phase)
        if name is None:
            return
        write, module = getattr(sharded, name), self.module

        def slow(*args, **kwargs):
            print(f"PHASE {module.phase} rank {trainer.global_rank} step {trainer.global_step}", flush=True)
            time.sleep(module.seconds)
            return write(*args, **kwargs)

        setattr(sharded, name, slow)


class Preemption(NamedTuple):
    """How a preempted job ended."""

    seconds: float  # from the SIGTERM to the last process's exit
    codes: list[int]  # the exit status of the launcher's process, then of those of its children we can read
    output: str  # every process's output together


def preempt(launcher: str, phase: str, delay: float, checkpoints: Path, port: int, timeout: float = 90) -> Preemption:
    """Start the job under ``launcher`` ("lightning": ``python preempt_job.py``, whose rank 0 starts
    rank 1; "torchrun"), wait until both ranks are in ``phase``, wait ``delay`` seconds more, then send
    SIGTERM to every process of the job at once, as a cluster does."""
    script = [str(Path(__file__).resolve()), "--phase", phase, "--checkpoints", str(checkpoints)]
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    else:
        command = [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port)}
    job = subprocess.Popen(command + script, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not all(any(f"PHASE {phase} rank {rank}" in line for line in list(lines)) for rank in (0, 1)):
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            raise RuntimeError(f"the job never reached {phase}:\n{''.join(lines)[-3000:]}")
        time.sleep(0.05)
    time.sleep(delay)
    processes = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    signalled = time.monotonic()
    for process in processes:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    codes = []
    try:
        codes.append(job.wait(timeout=timeout))
        _, alive = psutil.wait_procs(processes[1:], timeout=timeout)
        codes += [process.returncode for process in processes[1:] if getattr(process, "returncode", None) is not None]
    finally:
        for process in [job, *processes[1:]]:
            try:
                process.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
    seconds = time.monotonic() - signalled
    reader.join(timeout=10)
    assert not alive, f"still running {timeout:.0f} s after SIGTERM"
    return Preemption(seconds, codes, "".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=PHASES, required=True)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--checkpoints", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    module = Preempted(args.phase, args.seconds)
    trainer = L.Trainer(
        strategy=FSDPCustomStrategy(
            auto_wrap_policy={nn.Linear}, state_dict_type="sharded", async_save=args.phase == "async_save"
        ),
        accelerator="cpu",
        devices=2,
        max_steps=60,
        val_check_interval=4,
        limit_val_batches=3,
        num_sanity_val_steps=0,
        accumulate_grad_batches=2 if args.phase == "accumulation" else 1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                args.checkpoints, save_last=True, save_top_k=0, every_n_train_steps=2, save_on_exception=True
            ),
            SlowWrite(module),
        ],
    )
    data = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(0)))
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    print(f"FINISHED rank {trainer.global_rank} at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
