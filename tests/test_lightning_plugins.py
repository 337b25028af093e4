"""Trainer flags and plugins a Lightning user brings along: sync_batchnorm synchronizes
through the engine (oracle: BatchNorm on the global batch in one process), bf16-mixed buffers are
checkpointed in fp32, precision plugins are converted where their meaning is kept and refused
otherwise, whole-model averaging is refused."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy
from fsdp_strategy.checkpoint import consolidate

STEPS, PER_RANK = 3, 4


class NormNet(L.LightningModule):
    """Linear -> BatchNorm1d -> Linear, regression on fixed data."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(world: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    n = STEPS * PER_RANK * world
    return TensorDataset(torch.randn(n, 5, generator=generator) * 3 + 1, torch.randn(n, 1, generator=generator))


def _reference(world: int) -> dict:
    """One process, plain BatchNorm over each step's global batch, in the order Lightning deals it."""
    from torch.utils.data import DistributedSampler

    torch.manual_seed(0)
    module = NormNet()
    optimizer = module.configure_optimizers()
    data = _data(world)
    orders = [list(DistributedSampler(data, world, r, shuffle=True, seed=0)) for r in range(world)]
    losses = []
    for step in range(STEPS):
        index = [orders[r][i] for r in range(world) for i in range(step * PER_RANK, (step + 1) * PER_RANK)]
        x, y = data[index]
        loss = nn.functional.mse_loss(module.net(x), y)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "running_mean": module.net[1].running_mean.clone()}


def _plugins_body(rank: int, world: int, root: str) -> dict:
    from fsdp_strategy.checkpoint import full_state_dict

    result = {}
    for sync in (True, False):
        torch.manual_seed(0)
        module = NormNet()
        trainer = quiet_trainer(strategy=FSDPCustomStrategy(), devices=world, max_steps=STEPS, sync_batchnorm=sync)
        trainer.fit(module, DataLoader(_data(world), batch_size=PER_RANK))
        losses = torch.stack(module.losses)
        dist.all_reduce(losses)
        state = full_state_dict(trainer.strategy.model, rank0_only=False)
        result[sync] = {"losses": (losses / world).tolist(), "running_mean": state["net.1.running_mean"]}
        result[f"layer_{sync}"] = type(module.net[1]).__name__
    for kind in ("full", "sharded"):  # bf16-mixed casts buffers to bf16; checkpoints keep them in fp32
        torch.manual_seed(0)
        module = NormNet()
        strategy = FSDPCustomStrategy(state_dict_type=kind)
        trainer = quiet_trainer(strategy=strategy, devices=world, max_steps=1, precision="bf16-mixed")
        trainer.fit(module, DataLoader(_data(world), batch_size=PER_RANK))
        trainer.save_checkpoint(f"{root}/{kind}.ckpt")
        result[f"{kind}_live_dtype"] = module.net[1].running_mean.dtype
    for callbacks in ([StochasticWeightAveraging(swa_lrs=0.1)], [EMAWeightAveraging(), WeightAveraging()]):
        trainer = quiet_trainer(strategy=FSDPCustomStrategy(), devices=world, max_steps=1, callbacks=callbacks)
        try:
            trainer.fit(NormNet(), DataLoader(_data(world), batch_size=PER_RANK))
        except MisconfigurationException as error:
            result[f"averaging {len(callbacks)}"] = str(error)
    return result


def test_sync_batchnorm_buffer_dtypes_in_checkpoints_and_whole_model_averaging_refused(tmp_path):
    result = run_ranks(_plugins_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    reference = _reference(2)
    assert result["full_live_dtype"] == result["sharded_live_dtype"] == torch.bfloat16
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)["state_dict"]
    consolidated = torch.load(consolidate(tmp_path / "sharded.ckpt", tmp_path / "s.pt", weights_only=True))
    for state in (full, consolidated):
        assert state["net.1.running_mean"].dtype == torch.float32  # as FSDP1 saves them
    assert result["layer_True"] == "SyncBatchNorm" and result["layer_False"] == "BatchNorm1d"
    assert result[True]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert torch.allclose(result[True]["running_mean"], reference["running_mean"], rtol=1e-5, atol=1e-6)
    assert result[False]["losses"] != pytest.approx(reference["losses"], rel=1e-3)  # per-rank statistics differ
    assert "StochasticWeightAveraging cannot work with the fsdp_custom strategy" in result["averaging 1"]
    assert "WeightAveraging(avg_fn=get_swa_avg_fn())" in result["averaging 1"]
    assert "one WeightAveraging callback at a time" in result["averaging 2"]


def test_precision_plugins_are_converted_or_refused():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    trainer = L.Trainer(
        strategy=FSDPCustomStrategy(), accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler)]
    )
    plugin = trainer.strategy.precision_plugin
    plugin.attach("cpu", clip_fn=None)
    assert isinstance(plugin.scaler, ShardedGradScaler)  # its inf check covers every rank's shards
    assert (plugin.scaler.get_scale(), plugin.scaler.get_growth_interval()) == (1024.0, 7)

    for given, enabled in (
        (MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", enabled=False)), False),
        (FSDPPrecision("16-mixed"), True),
    ):  # FSDPPrecision's scaler is built for CUDA
        trainer = L.Trainer(strategy=FSDPCustomStrategy(), accelerator="cpu", devices=1, plugins=[given])
        plugin = trainer.strategy.precision_plugin
        plugin.attach("cpu", clip_fn=None)
        assert (plugin.scaler.is_enabled(), plugin.scaler._device) == (enabled, "cpu"), type(given).__name__

    class LoggingPrecision(Precision):
        def pre_backward(self, tensor, module):
            return tensor

    with pytest.raises(TypeError, match="cannot honour the precision plugin LoggingPrecision"):
        L.Trainer(strategy=FSDPCustomStrategy(), accelerator="cpu", devices=1, plugins=[LoggingPrecision()])
