"""The monitors, logging to a real offline W&B run that is read back from disk."""

from __future__ import annotations

import math
import os

import lightning as L
import pytest
import torch
from dist_utils import run_ranks
from lightning.pytorch.loggers import WandbLogger
from models import Block, TiedLM
from test_strategy import LIGHTNING_ENV, LitLM
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy
from fsdp_strategy.callbacks import CommunicationMonitor, MemoryMonitor, ThroughputMonitor
from fsdp_strategy.callbacks.wandb_history import history

MIB = 2**20
STEPS = 4


def _fit_with_monitors(rank: int, world: int, root: str) -> None:
    os.environ.update({"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DIR": root})
    torch.manual_seed(0)
    module = LitLM()
    module.flops_per_batch = 1000  # FLOPs of one rank's batch, as measure_flops would give
    logger = WandbLogger(project="fsdp-test", save_dir=root, offline=True)
    trainer = L.Trainer(
        strategy=FSDPCustomStrategy(auto_wrap_policy={Block}),
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=logger,
        callbacks=[
            MemoryMonitor(log_every_n_steps=1),
            ThroughputMonitor(log_every_n_steps=1, window_size=2),
            CommunicationMonitor(log_every_n_steps=2, per_unit=True),
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.randint(0, 37, (STEPS * 2 * world, 7))
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=2))
    if rank == 0:
        logger.experiment.finish()  # a forked rank ends without atexit hooks: flush the run now


def _padded_bytes(world: int) -> tuple[float, int]:
    model = TiedLM()
    total = sum(
        4 * math.ceil((p.shape[0] if p.dim() else 1) / world) * p[0].numel() if p.dim() else 4
        for p in model.parameters()
    )
    return total / MIB, sum(p.numel() * 4 for p in model.parameters())


def test_monitors_log_to_offline_wandb(tmp_path):
    world = 2
    run_ranks(_fit_with_monitors, world, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)
    rows = history(tmp_path / "wandb")
    merged: dict[str, list] = {}
    for row in rows:
        for key, value in row.items():
            merged.setdefault(key, []).append(value)

    sharded_mib, full_bytes = _padded_bytes(world)
    assert merged["memory/sharded_params/max"][-1] == pytest.approx(sharded_mib)
    assert merged["memory/sharded_params/min"][-1] == pytest.approx(sharded_mib)
    assert sharded_mib < full_bytes / MIB / world * 1.1  # 1/N of the model, plus padding
    assert merged["memory/optimizer_state/mean"][-1] > 0
    assert all(v == 0 for v in merged["memory/gathered_now/max"])  # everything resharded after a step
    assert max(merged["memory/gathered_peak/max"]) > 0
    assert merged["memory/rss/max_rank"][-1] in (0.0, 1.0)
    assert min(merged["memory/rss/min"]) > 10
    assert len(merged["memory/rss/max"]) == STEPS

    # root, blocks.0, blocks.1 run ("skipped" never does): 3 gathers in forward, 2 again in backward
    assert merged["comm/all_gather/calls"][-1] == 3 + 2
    assert merged["comm/reduce_scatter/calls"][-1] == 3
    assert merged["comm/all_gather/wire_mib"][-1] > 0 and merged["comm/all_gather/bandwidth_mib_s"][-1] > 0
    assert merged["comm/unit/root/all_gather/calls"][-1] == 1  # the root is gathered once (kept to backward)
    assert min(merged["comm/exposed_s/max"]) >= 0
    assert len(merged["comm/all_gather/calls"]) == STEPS // 2

    samples = merged["throughput/samples_per_sec"]
    assert samples and all(v > 0 for v in samples)
    tokens = merged["throughput/items_per_sec"]
    assert tokens[-1] == pytest.approx(samples[-1] * 7)  # 7 tokens per sample
    assert merged["throughput/flops_per_sec"][-1] == pytest.approx(samples[-1] / 2 * 1000)  # 1000 FLOPs per 2 samples
    assert all(v > 0 for v in merged["throughput/step_time_s"])


class _LoggingLM(LitLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def _fit_accumulating(rank: int, world: int, root: str) -> None:
    os.environ.update({"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DIR": root})
    torch.manual_seed(0)
    logger = WandbLogger(project="fsdp-test", save_dir=root, offline=True)
    trainer = L.Trainer(
        strategy=FSDPCustomStrategy(auto_wrap_policy={Block}),
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        logger=logger,
        callbacks=[MemoryMonitor(), CommunicationMonitor()],  # the Trainer's log_every_n_steps
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.randint(0, 37, (STEPS * 2 * 2 * world, 7))
    trainer.fit(_LoggingLM(), DataLoader(TensorDataset(data), batch_size=2))
    if rank == 0:
        logger.experiment.finish()


def test_monitors_report_per_optimizer_step_in_lightning_rows(tmp_path):
    """With accumulate_grad_batches=2 the monitors log once per optimizer step, micro-batches
    summed, in the same W&B rows as Lightning's own ``self.log`` metrics, at the Trainer's
    ``log_every_n_steps`` when given none of their own."""
    run_ranks(_fit_accumulating, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)
    rows = history(tmp_path / "wandb")

    def steps(key: str) -> list[int]:
        return sorted({row["trainer/global_step"] for row in rows if key in row})

    assert steps("train_loss") == [1, 3]  # Lightning: every 2nd optimizer step
    assert steps("comm/all_gather/calls") == steps("memory/rss/max") == [1, 3]
    comm = [row for row in rows if "comm/all_gather/calls" in row]
    # two micro-batches of (3 gathers in forward + 2 in backward); one reduction of the 3 units
    assert [row["comm/all_gather/calls"] for row in comm] == [10, 10]
    assert [row["comm/reduce_scatter/calls"] for row in comm] == [3, 3]


def test_wandb_history_reads_a_resumed_run_as_one(tmp_path):
    """A run resumed from an older checkpoint (step 2 after reaching step 4) is read as W&B shows it:
    the first part's rows up to the resume step, then the resumed part's."""
    import wandb

    os.environ.update({"WANDB_SILENT": "true"})
    for steps in (range(5), range(2, 4)):
        run = wandb.init(mode="offline", dir=tmp_path, project="fsdp-test", id="resumed1", resume="allow")
        for step in steps:
            run.log({"trainer/global_step": step, "loss": 10.0 * step + len(steps)})
        run.finish()
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2
    rows = [(row["trainer/global_step"], row["loss"]) for row in history(tmp_path / "wandb")]
    assert rows == [(0, 5.0), (1, 15.0), (2, 22.0), (3, 32.0)], rows


def test_the_history_reader_prints_one_row_per_step():
    """Each logging call of a step is a W&B row of its own (the monitors', the loss's, validation's): the
    CSV merges a step's rows, so a step is one line with every key it logged."""
    from fsdp_strategy.callbacks.wandb_history import one_row_per_step

    rows = [
        {"trainer/global_step": 0, "train_loss": 4.0},
        {"trainer/global_step": 0, "memory/gathered_peak/max": 3.2},
        {"trainer/global_step": 1, "train_loss": 3.5},
        {"trainer/global_step": 1, "val_loss": 3.9},
        {"epoch": 0},
    ]
    assert one_row_per_step(rows) == [
        {"trainer/global_step": 0, "train_loss": 4.0, "memory/gathered_peak/max": 3.2},
        {"trainer/global_step": 1, "train_loss": 3.5, "val_loss": 3.9},
        {"epoch": 0},
    ]
