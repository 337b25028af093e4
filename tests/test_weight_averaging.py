"""Lightning's ``WeightAveraging`` callbacks on fsdp_custom ([Note: sharded weight averaging]):
each rank averages its own shards. Checked against the same callback under Lightning on one
device with the global batch (the average and the final weights must agree), through Lightning's
own assertions of the callback's bookkeeping (updates per step, swaps around validation, the copy
at the end, a ``configure_model`` model), and across checkpoints: a run stopped mid-way and
resumed from a full or a sharded checkpoint ends where the uninterrupted run does."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from fsdp_strategy import FSDPCustomStrategy
from fsdp_strategy.checkpoint import consolidate, full_state_dict

EPOCHS = 4
SAMPLES = 32


class Net(BoringModel):
    """Lightning's BoringModel with a two-layer net built in ``__init__`` or in ``configure_model``."""

    def __init__(self, in_configure_model: bool = False, crash_at_epoch: int | None = None) -> None:
        super().__init__()
        self.in_configure_model = in_configure_model
        self.crash_at_epoch = crash_at_epoch
        self.layer = None if in_configure_model else self._build()

    @staticmethod
    def _build() -> nn.Module:
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def configure_model(self):
        if self.in_configure_model and self.layer is None:
            self.layer = self._build()

    def training_step(self, batch, batch_idx):
        if self.crash_at_epoch is not None and self.current_epoch == self.crash_at_epoch:
            raise RuntimeError("CRASH")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Halves:
    """EMA with decay 0.5 (a picklable averaging function)."""

    @torch.no_grad()
    def __call__(self, average, current, count):
        return 0.5 * average + 0.5 * current


class CountingEMA(WeightAveraging):
    """Asserts the callback's bookkeeping as Lightning's own EMA test does."""

    def __init__(self, steps_per_epoch: int) -> None:
        super().__init__(avg_fn=Halves())
        self.steps_per_epoch = steps_per_epoch
        self.swaps = self.copies = 0
        self.first_epoch: int | None = None

    def _swap_models(self, *args, **kwargs):
        self.swaps += 1
        return super()._swap_models(*args, **kwargs)

    def _copy_average_to_current(self, *args, **kwargs):
        self.copies += 1
        return super()._copy_average_to_current(*args, **kwargs)

    def on_train_epoch_start(self, trainer, *args):
        super().on_train_epoch_start(trainer, *args)
        if self.first_epoch is None and not trainer.fit_loop.restarting:
            self.first_epoch = trainer.current_epoch

    def on_train_epoch_end(self, trainer, *args):
        super().on_train_epoch_end(trainer, *args)
        assert self._average_model.n_averaged == trainer.global_step
        assert self.swaps == (trainer.current_epoch + 1 - self.first_epoch) * 2 and self.copies == 0

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        assert self._average_model.n_averaged == trainer.max_epochs * self.steps_per_epoch
        assert self.copies == 1


def _fit(devices: int, world: int, strategy: object, model: Net, root: Path, **kwargs) -> tuple[L.Trainer, Net]:
    steps = SAMPLES // (4 * world) // 2  # batches of 4 per rank, accumulating 2
    torch.manual_seed(1)  # the same data in every run, however much randomness ran before
    dataset = RandomDataset(32, SAMPLES)
    sampler = DistributedSampler(dataset, shuffle=False) if devices > 1 else None
    loader = DataLoader(dataset, batch_size=4 if devices > 1 else 4 * world, sampler=sampler)
    checkpoint = kwargs.pop("checkpoint", None)
    callbacks = [CountingEMA(steps)] + ([checkpoint] if checkpoint else [])
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_epochs=EPOCHS,
        accumulate_grad_batches=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        enable_checkpointing=checkpoint is not None,
        use_distributed_sampler=False,
        default_root_dir=root,
    )
    trainer.fit(model, loader, val_dataloaders=DataLoader(dataset, batch_size=4), **kwargs)
    return trainer, model


def _state(trainer: L.Trainer, model: Net) -> dict[str, torch.Tensor]:
    if isinstance(trainer.strategy, FSDPCustomStrategy):
        return full_state_dict(trainer.strategy.model, rank0_only=False)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _stop_and_resume(devices: int, world: int, strategy: object, folder: Path) -> dict[str, torch.Tensor]:
    """Fit until a crash at epoch 2 (checkpoints every epoch), then resume from ``last.ckpt``."""
    torch.manual_seed(0)
    every_epoch = ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=1)
    try:
        _fit(devices, world, strategy(), Net(crash_at_epoch=2), folder, checkpoint=every_epoch)
    except RuntimeError:
        pass
    if devices > 1:
        dist.barrier()
    return _state(*_fit(devices, world, strategy(), Net(), folder, ckpt_path=str(folder / "last.ckpt")))


def _sharded_body(rank: int, world: int, root: str) -> dict:
    result = {}
    for in_configure_model in (False, True):
        torch.manual_seed(0)
        trainer, model = _fit(world, world, FSDPCustomStrategy(), Net(in_configure_model), Path(root))
        average = trainer.callbacks[0]._average_model.module
        result[in_configure_model] = _state(trainer, model)
        result[f"{in_configure_model} layer"] = type(average.layer).__name__
        result[f"{in_configure_model} shapes"] = [tuple(p.shape) for p in average.parameters()]
    for kind in ("full", "sharded"):
        result[kind] = _stop_and_resume(
            world, world, lambda kind=kind: FSDPCustomStrategy(state_dict_type=kind), Path(root) / kind
        )
    return result


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{what} {n}: {m}")


def test_weight_averaging_averages_the_shards_as_one_device_averages_the_model(tmp_path):
    world = 2
    torch.manual_seed(0)
    expected = _state(*_fit(1, world, "auto", Net(), tmp_path))
    # Lightning's own stop-and-resume of WeightAveraging (its checkpoint holds the average under
    # "state_dict" and the model under "current_model_state") is the oracle for ours
    expected_resumed = _stop_and_resume(1, world, lambda: "auto", tmp_path / "one_device")
    _assert_same(expected_resumed, expected, "one device, resumed")  # the data do not depend on the RNG
    result = run_ranks(_sharded_body, world, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=400)[0]
    _assert_same(result[False], expected, "uninterrupted")
    _assert_same(result["full"], expected_resumed, "resumed from a full checkpoint")
    _assert_same(result["sharded"], expected_resumed, "resumed from a sharded checkpoint")
    # the checkpoints keep Lightning's layout: the average under "state_dict", the model apart
    full = torch.load(tmp_path / "full" / "last.ckpt", weights_only=True)
    consolidated = torch.load(consolidate(tmp_path / "sharded" / "last.ckpt", tmp_path / "c.pt"), weights_only=True)
    for state in (full, consolidated):
        assert state["state_dict"]["layer.0.weight"].shape == state["current_model_state"]["layer.0.weight"].shape
        assert not torch.equal(state["state_dict"]["layer.0.weight"], state["current_model_state"]["layer.0.weight"])
        assert state["averaging_state"]["n_averaged"] == 4  # two epochs of two steps
    torch.testing.assert_close(consolidated["state_dict"], full["state_dict"])
    # a configure_model model: the callback's own assertions held, the average has its layers, as shards
    assert result["True layer"] == "Sequential"
    assert result["True shapes"][0] == result["False shapes"][0] == (16, 32)  # 32 rows, half on each rank
