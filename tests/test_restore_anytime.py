"""A checkpoint restored at any point of a run is in effect when the restore returns, as under DDP:
Lightning's tuner (``lr_find``) and the ``LearningRateFinder`` callback
restore their temporary checkpoint after setup and delete it right after; ``validate``/``test``/
``predict`` restore between runs. Each sequence runs under ``fsdp_custom`` (full and sharded
checkpoints) and under Lightning's DDP in the same ranks; the oracle is DDP's numbers."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.tuner import Tuner
from models import Block, TiedLM, lm_loss, make_batches
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy

DDP = "ddp_find_unused_parameters_true"  # TiedLM has a block that never runs


class TunedLM(L.LightningModule):
    """TiedLM with Adam at ``self.lr`` and ``self.batch_size`` (what the tuner sets)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TiedLM()
        self.lr = 1e-3
        self.batch_size = 2
        self.losses: list[float] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(make_batches(1, 96)[0]), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.net, batch[0])
        self.losses.append(loss.item())
        return loss

    def test_step(self, batch, batch_idx):
        self.log("test_loss", lm_loss(self.net, batch[0]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0][:, :-1]).sum()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _strategy(name: str):
    if name == "ddp":
        return DDP
    return FSDPCustomStrategy(auto_wrap_policy={Block}, state_dict_type=name)


def _mean(values: list[float]) -> list[float]:
    local = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(local)
    return (local / dist.get_world_size()).tolist()


def _lr_find_then_fit(name: str, root: str) -> dict:
    torch.manual_seed(0)
    module = TunedLM()
    trainer = quiet_trainer(strategy=_strategy(name), devices=2, max_steps=6, default_root_dir=f"{root}/{name}")
    finder = Tuner(trainer).lr_find(module, min_lr=1e-4, max_lr=1e-1, num_training=30, early_stop_threshold=None)
    module.losses = []
    trainer.fit(module)
    return {
        "suggested": finder.suggestion(),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "losses": _mean(module.losses),
    }


def _finder_callback_then_test(name: str, root: str) -> dict:
    torch.manual_seed(0)
    module = TunedLM()
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1e-1, num_training_steps=30, early_stop_threshold=None)
    trainer = quiet_trainer(
        strategy=_strategy(name), devices=2, max_steps=6, default_root_dir=f"{root}/{name}", callbacks=[finder]
    )
    trainer.fit(module)
    losses = _mean(module.losses)
    loader = DataLoader(TensorDataset(make_batches(1, 24, seed=5)[0]), batch_size=4)
    tested = trainer.test(module, loader, verbose=False)[0]["test_loss"]
    return {"losses": losses, "test_loss": tested, "lr": module.lr}


def _between_runs(name: str, root: str) -> dict:
    """fit (checkpoints at steps 3 and 6), then test, predict and validate, each from another checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    module = TunedLM()
    folder = f"{root}/{name}/ckpts"
    every = ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1)
    trainer = quiet_trainer(
        strategy=_strategy(name), devices=2, max_steps=6, callbacks=[every], enable_checkpointing=True
    )
    trainer.fit(module)
    loader = DataLoader(TensorDataset(make_batches(1, 24, seed=5)[0]), batch_size=4)
    early = trainer.test(module, loader, ckpt_path=f"{folder}/epoch=0-step=3.ckpt", verbose=False)[0]["test_loss"]
    late = trainer.predict(module, loader, ckpt_path=f"{folder}/epoch=0-step=6.ckpt")
    again = trainer.test(module, loader, ckpt_path=f"{folder}/epoch=0-step=3.ckpt", verbose=False)[0]["test_loss"]
    return {"early": early, "late": _mean([float(p) for p in late]), "again": again}


def _body(rank: int, world: int, root: str, sequence: str) -> dict:
    run = {"lr_find": _lr_find_then_fit, "callback": _finder_callback_then_test, "between_runs": _between_runs}
    return {name: run[sequence](name, root) for name in ("full", "sharded", "ddp")}


# Lightning refuses batch size tuning (Tuner.scale_batch_size, BatchSizeFinder) for every distributed strategy
@pytest.mark.parametrize("sequence", ["lr_find", "callback", "between_runs"])
def test_a_restore_after_setup_is_in_effect_when_it_returns(tmp_path, sequence):
    result = run_ranks(_body, 2, tmp_path, str(tmp_path), sequence, env=LIGHTNING_ENV, timeout=300)[0]
    ddp = result["ddp"]
    for name in ("full", "sharded"):
        for key, value in ddp.items():
            assert result[name][key] == pytest.approx(value, rel=1e-5), (name, key, result[name][key], value)
    assert not list(tmp_path.rglob(".lr_find_*"))  # the tuner's checkpoints were removed after their restore
