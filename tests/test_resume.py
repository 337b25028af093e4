"""Lightning checkpoints end to end: exact resume (mid-epoch, schedulers, both formats), resume on
another world size, consolidation into DDP, crash-safe and async saves, ModelCheckpoint."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from dist_utils import RankFailure, run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from models import Block, lm_loss, make_batches
from test_strategy import LIGHTNING_ENV, LitLM, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy
from fsdp_strategy.checkpoint import consolidate, layout

PER_RANK = 2
SAMPLES = 16  # 4 steps per epoch at world size 2: checkpoints at steps 3 and 6 are mid-epoch


class ScheduledLM(LitLM):
    """LitLM with a step LR schedule, so schedulers must be restored too."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", lm_loss(self.net, batch[0]), sync_dist=True)

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


def _data(samples: int = SAMPLES) -> torch.Tensor:
    return make_batches(samples, 1).reshape(samples, -1)


def _trainer(world: int, root: Path, max_steps: int, state_dict_type: str = "sharded", **kwargs) -> L.Trainer:
    callback_args = kwargs.pop("checkpoint", {"every_n_train_steps": 3, "save_top_k": -1, "save_last": True})
    strategy = FSDPCustomStrategy(
        auto_wrap_policy={Block}, state_dict_type=state_dict_type, async_save=kwargs.pop("async_save", False)
    )
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=max_steps,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=root, **callback_args), *kwargs.pop("callbacks", [])],
        enable_progress_bar=kwargs.pop("enable_progress_bar", False),
        enable_model_summary=False,
        default_root_dir=root,
        **{"limit_val_batches": 0, **kwargs},
    )


def _fit(rank, world, root, max_steps, ckpt_path=None, state_dict_type="sharded", global_batch=None, **kwargs) -> dict:
    """Fit ScheduledLM; ``global_batch``: samples per step over all ranks, the same at any world size
    (then every step trains on the same samples whatever the world size); default PER_RANK per rank."""
    torch.manual_seed(0)
    module = ScheduledLM()
    trainer = _trainer(world, Path(root), max_steps, state_dict_type, **kwargs)
    per_rank, samples = (PER_RANK, SAMPLES) if global_batch is None else (global_batch // world, 4 * global_batch)
    trainer.fit(module, DataLoader(TensorDataset(_data(samples)), batch_size=per_rank), ckpt_path=ckpt_path)
    losses = torch.stack(module.losses) if module.losses else torch.zeros(0)
    dist.all_reduce(losses)
    return {
        "losses": (losses / world).tolist(),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "epoch": trainer.current_epoch,
        "step": trainer.global_step,
    }


def _resume_body(rank: int, world: int, root: str, state_dict_type: str) -> dict:
    uninterrupted = _fit(rank, world, f"{root}/a", 8, state_dict_type=state_dict_type)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(rank, world, f"{root}/b", 8, f"{root}/a/epoch=1-step=6.ckpt", state_dict_type)
        hidden_after = [f for f in warnings.filters if f[1] is not None and "not resumable" in f[1].pattern]
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "files": sorted(os.listdir(f"{root}/a")),
        "warnings": [str(w.message) for w in caught],
        "log": records,
        "filters_left": len(hidden_after),
    }


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_resume_is_exact_at_the_same_world_size(tmp_path, state_dict_type):
    result = run_ranks(_resume_body, 2, tmp_path, str(tmp_path), state_dict_type, env=LIGHTNING_ENV, timeout=300)[0]
    assert result["files"] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    full, resumed = result["uninterrupted"], result["resumed"]
    assert resumed["losses"] == pytest.approx(full["losses"][6:], rel=1e-6, abs=1e-6)  # mid-epoch 1, step 6
    assert (resumed["lr"], resumed["epoch"], resumed["step"]) == (full["lr"], full["epoch"], full["step"])
    # an exact resume: Lightning's "dataloader is not resumable" warning would contradict it
    assert not [w for w in result["warnings"] if "not resumable" in w], result["warnings"]
    assert any("resuming epoch 1 after its first 8 samples, exactly where" in line for line in result["log"])
    assert result["filters_left"] == 0  # the warning shows again for later fits


def _epoch_end_resume_body(rank: int, world: int, root: str) -> dict:
    """Resume from the checkpoint of an epoch's last batch, with the example's progress bar."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from progress import ResumedEpochProgressBar

    class RecordingBar(ResumedEpochProgressBar):
        seen: list = []

        def on_train_batch_end(self, trainer, *args):
            super().on_train_batch_end(trainer, *args)
            bar = self.train_progress_bar
            if trainer.is_global_zero:  # the other ranks' bars are disabled
                self.seen.append((trainer.current_epoch, bar.n, bar.initial, bar.total))

    every_epoch = {"checkpoint": {"every_n_train_steps": 2, "save_top_k": -1}}  # mid-epoch (2), epoch end (4)
    uninterrupted = _fit(rank, world, f"{root}/a", 8, **every_epoch)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    bar = RecordingBar()
    resumed = _fit(
        rank, world, f"{root}/b", 7, f"{root}/a/epoch=0-step=4.ckpt", callbacks=[bar], enable_progress_bar=True
    )
    return {"uninterrupted": uninterrupted, "resumed": resumed, "log": records, "bar": bar.seen}


def test_resume_from_an_epochs_last_batch(tmp_path):
    result = run_ranks(_epoch_end_resume_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    full, resumed = result["uninterrupted"], result["resumed"]
    assert resumed["losses"] == pytest.approx(full["losses"][4:7], rel=1e-6, abs=1e-6)  # epoch 1 from its start
    assert not [line for line in result["log"] if "resuming epoch" in line], result["log"]
    assert result["bar"] == [(1, n, 0, 3) for n in (1, 2, 3)], result["bar"]  # Epoch 1: n/3 (max_steps=7)
    # the same checkpoints (world 2: 4 batches of 4 samples per epoch) resumed at world 1 (8 batches of 2)
    other = run_ranks(_other_world_body, 1, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    everything = sorted(tuple(row) for row in _data().tolist())
    assert sorted(other["epoch_end"]["rows"][1]) == everything  # the whole next epoch, none skipped
    assert other["epoch_end"]["bar"] == [(1, n, 0, 8) for n in range(1, 9)], other["epoch_end"]["bar"]
    assert not [line for line in other["epoch_end"]["log"] if "resuming epoch" in line]
    assert len(set(other["mid_epoch"]["rows"][0])) == 8  # after 8 of 16 samples: the other 8
    assert other["mid_epoch"]["bar"] == [(0, n, 4, 8) for n in range(5, 9)], other["mid_epoch"]["bar"]
    assert any("resuming epoch 0 after its first 8 samples" in line for line in other["mid_epoch"]["log"])


def _other_world_body(rank: int, world: int, root: str) -> dict:
    """Resume the world-2 checkpoints of ``_epoch_end_resume_body`` at this world size: the rows each
    epoch trained on, the bar, the log."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from progress import ResumedEpochProgressBar

    class RecordingBar(ResumedEpochProgressBar):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            bar = self.train_progress_bar
            self.seen.append((trainer.current_epoch, bar.n, bar.initial, bar.total))
            pl_module.rows.setdefault(trainer.current_epoch, []).extend(tuple(row) for row in batch[0].tolist())

    results = {}
    resumes = [("epoch_end", "epoch=0-step=4.ckpt", 12), ("mid_epoch", "epoch=0-step=2.ckpt", 6)]
    for name, checkpoint, max_steps in resumes:
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record, records=records: records.append(record.getMessage())
        logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
        module, bar = ScheduledLM(), RecordingBar()
        module.rows = {}
        trainer = _trainer(
            world, Path(root) / name, max_steps, checkpoint={}, callbacks=[bar], enable_progress_bar=True
        )
        loader = DataLoader(TensorDataset(_data()), batch_size=PER_RANK)
        trainer.fit(module, loader, ckpt_path=f"{root}/a/{checkpoint}")
        logging.getLogger("lightning.pytorch.utilities.rank_zero").removeHandler(handler)
        results[name] = {"rows": module.rows, "bar": bar.seen, "log": records}
    return results


def _validate(rank, world, root, ckpt, state_dict_type="sharded", log_records=None) -> float:
    torch.manual_seed(1)  # a different init: the weights must come from the checkpoint
    module = ScheduledLM()
    trainer = _trainer(world, Path(root), 1, state_dict_type, checkpoint={}, limit_val_batches=1.0)
    loader = DataLoader(TensorDataset(_data()[:12]), batch_size=PER_RANK)  # 12 splits evenly over 1, 2 or 3 ranks
    return trainer.validate(module, loader, ckpt_path=ckpt, verbose=False)[0]["val_loss"]


GLOBAL_BATCH = 6  # samples per step at world 1, 2 and 3 alike: 4 steps per epoch of 24 samples


def _save_at(rank: int, world: int, root: str, state_dict_type: str) -> dict:
    """Save at step 3 (mid-epoch), then run 6 steps uninterrupted: the oracle of a resume anywhere."""
    _fit(rank, world, root, 3, state_dict_type=state_dict_type, global_batch=GLOBAL_BATCH)
    val_loss = _validate(rank, world, root + "/v", f"{root}/last.ckpt", state_dict_type)
    uninterrupted = _fit(rank, world, root + "/u", 6, state_dict_type=state_dict_type, global_batch=GLOBAL_BATCH)
    return {"val_loss": val_loss, "uninterrupted": uninterrupted}


def _load_at(rank: int, world: int, root: str, ckpt: str, state_dict_type: str) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    val_loss = _validate(rank, world, root + "/v", ckpt, state_dict_type)
    continued = _fit(rank, world, root + "/c", 6, ckpt, state_dict_type, global_batch=GLOBAL_BATCH)
    return {"val_loss": val_loss, "log": records, "continued": continued}


@pytest.mark.parametrize(
    ("saved_world", "loaded_world", "state_dict_type"),
    [(2, 1, "sharded"), (1, 2, "sharded"), (2, 3, "sharded"), (2, 3, "full")],
)
def test_resume_on_another_world_size(tmp_path, saved_world, loaded_world, state_dict_type):
    root = str(tmp_path / "saved")
    saved = run_ranks(_save_at, saved_world, tmp_path, root, state_dict_type, env=LIGHTNING_ENV, timeout=300)[0]
    result = run_ranks(
        _load_at,
        loaded_world,
        tmp_path,
        str(tmp_path / "loaded"),
        f"{root}/last.ckpt",
        state_dict_type,
        env=LIGHTNING_ENV,
        timeout=300,
    )[0]
    assert result["val_loss"] == pytest.approx(saved["val_loss"], rel=1e-5)
    continued = result["continued"]
    assert continued["step"] == 6 and len(continued["losses"]) == 3  # steps 4..6 after the restored 3
    # the same samples per step at any world size: the resumed steps are the uninterrupted run's (weights,
    # Adam's moments, the LR schedule and the data position all restored)
    assert continued["losses"] == pytest.approx(saved["uninterrupted"]["losses"][3:], rel=1e-5)
    assert continued["lr"] == pytest.approx(saved["uninterrupted"]["lr"])
    if state_dict_type == "sharded" and saved_world != loaded_world:
        report = [m for m in result["log"] if "loading" in m and "resharded" in m]
        shards = f"{loaded_world} shard" + ("s" if loaded_world != 1 else "")
        assert report and f"from {saved_world} to {shards}" in report[0]


def _ddp_resume(rank: int, world: int, root: str, consolidated: str) -> dict:
    torch.manual_seed(1)
    module = ScheduledLM()
    trainer = quiet_trainer(strategy="ddp_find_unused_parameters_true", devices=world, max_steps=6, limit_val_batches=0)
    trainer.fit(module, DataLoader(TensorDataset(_data()), batch_size=PER_RANK), ckpt_path=consolidated)
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    return {"losses": (losses / world).tolist(), "step": trainer.global_step}


def test_sharded_checkpoint_consolidates_into_plain_module_and_ddp(tmp_path):
    root = tmp_path / "run"
    at_epoch_end = {"every_n_train_steps": 4, "save_last": True}  # DDP resumes whole epochs only
    run_ranks(lambda r, w: _fit(r, w, str(root), 4, checkpoint=at_epoch_end), 2, tmp_path, env=LIGHTNING_ENV)
    single = run_ranks(_load_at, 1, tmp_path, str(tmp_path / "w1"), f"{root}/last.ckpt", "sharded", env=LIGHTNING_ENV)
    assert single[0]["continued"]["step"] == 6  # the sharded folder also loads on one rank
    out = consolidate(root / "last.ckpt", tmp_path / "consolidated.ckpt")
    checkpoint = torch.load(out, weights_only=False)
    plain = ScheduledLM()
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    assert checkpoint["global_step"] == 4
    ddp = run_ranks(_ddp_resume, 2, tmp_path, str(tmp_path), str(out), env=LIGHTNING_ENV, timeout=300)[0]
    uninterrupted = run_ranks(
        lambda r, w: _fit(r, w, str(tmp_path / "u"), 6), 2, tmp_path, env=LIGHTNING_ENV, timeout=300
    )[0]
    assert ddp["step"] == 6
    assert ddp["losses"] == pytest.approx(uninterrupted["losses"][4:], rel=1e-5)


def _crashing_save(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    original = dcp.FileSystemWriter.write_data
    calls = {"n": 0}

    def write_data(self, plan, planner):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 3:  # the third save (step 6's, after steps 3 and its "last")
            os._exit(17)  # the rank dies mid-save, its shards half written
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_data
    _fit(rank, world, root, 8)


def test_rank_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    root = tmp_path / "crash"
    results = run_ranks(_crashing_save, 2, tmp_path, str(root), env=LIGHTNING_ENV, timeout=300, allow_failure=True)
    assert isinstance(results[1], RankFailure) and "exit code 17" in results[1].error
    assert isinstance(results[0], RankFailure)  # the survivor fails instead of hanging
    finals = sorted(p.name for p in root.iterdir() if p.suffix == ".ckpt" and not p.name.startswith("."))
    assert finals == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert sorted(p.name for p in root.iterdir() if p.suffix == ".json") == ["fsdp_custom_flight_rank0.json"]
    assert all(layout.is_sharded_checkpoint(root / name) for name in finals)
    assert layout.read_meta(root / "last.ckpt")["checksums"]  # last still points to the complete step-3 save
    resumed = run_ranks(
        lambda r, w: _fit(r, w, str(tmp_path / "after"), 8, str(root / "last.ckpt")),
        2,
        tmp_path,
        env=LIGHTNING_ENV,
        timeout=300,
    )[0]
    uninterrupted = run_ranks(
        lambda r, w: _fit(r, w, str(tmp_path / "u"), 8), 2, tmp_path, env=LIGHTNING_ENV, timeout=300
    )[0]
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][3:], rel=1e-6, abs=1e-6)


def _async_body(rank: int, world: int, root: str) -> dict:
    result = _fit(rank, world, root + "/a", 8, async_save=True)
    resumed = _fit(rank, world, root + "/b", 8, root + "/a/epoch=1-step=6.ckpt", async_save=True)
    return {"full": result, "resumed": resumed, "files": sorted(os.listdir(root + "/a"))}


def test_async_save_commits_complete_checkpoints(tmp_path):
    result = run_ranks(_async_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    assert result["files"] == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    assert result["resumed"]["losses"] == pytest.approx(result["full"]["losses"][6:], rel=1e-6, abs=1e-6)


def _top_k_body(rank: int, world: int, root: str, state_dict_type: str) -> list[str]:
    checkpoint = {"every_n_train_steps": 1, "save_top_k": 2, "monitor": "train_loss", "save_last": True}
    torch.manual_seed(0)
    module = ScheduledLM()
    module.training_step = lambda batch, idx, m=module: _logged_step(m, batch)
    trainer = _trainer(world, Path(root), 6, state_dict_type, checkpoint=checkpoint)
    trainer.fit(module, DataLoader(TensorDataset(_data()), batch_size=PER_RANK))
    dist.barrier()
    return sorted(os.listdir(root))


def _logged_step(module: ScheduledLM, batch) -> torch.Tensor:
    loss = lm_loss(module.net, batch[0])
    module.log("train_loss", loss, sync_dist=True)
    return loss


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_model_checkpoint_top_k_removes_old_checkpoints(tmp_path, state_dict_type):
    root = tmp_path / "topk"
    files = run_ranks(_top_k_body, 2, tmp_path, str(root), state_dict_type, env=LIGHTNING_ENV, timeout=300)[0]
    kept = [f for f in files if f != "last.ckpt"]
    assert len(kept) == 2 and "last.ckpt" in files and not [f for f in files if f.startswith(".")]


def _validate_then_fit(rank: int, world: int, root: str) -> int:
    _fit(rank, world, root + "/a", 3)  # epoch=0-step=3.ckpt: 3 of the epoch's 4 steps done
    module = ScheduledLM()
    trainer = _trainer(world, Path(root) / "b", -1, checkpoint={}, max_epochs=1, limit_val_batches=1.0)
    loader = DataLoader(TensorDataset(_data()), batch_size=PER_RANK)
    trainer.validate(module, loader, ckpt_path=f"{root}/a/epoch=0-step=3.ckpt", verbose=False)
    trainer.fit(module, loader)  # a new run: the whole epoch, not the checkpoint's remaining step
    return trainer.global_step


def test_a_checkpoint_validated_leaves_no_data_position_for_the_next_fit(tmp_path):
    assert run_ranks(_validate_then_fit, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0] == 4
