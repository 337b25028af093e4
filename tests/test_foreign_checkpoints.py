"""Checkpoints from wherever Lightning users have them: DCP folders written by plain FSDP2 (as
torchtitan writes them: ``model`` and ``optim`` keys, no Lightning state), in Lightning
ModelParallelStrategy's layout (``state_dict``, ``optimizer_0`` and ``meta.pt``), loaded into the
Trainer (weights and optimizer state; loops start fresh, said in one line) and into Fabric (under
the user's keys) at another world size; and any checkpoint loaded into a plain module in one
process (``load_from_checkpoint``). The oracle is FSDP2's own full state dicts."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning.fabric import Fabric
from models import VOCAB, Block, lm_loss, make_batches
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomFabricStrategy, FSDPCustomStrategy
from fsdp_strategy.checkpoint import full_optimizer_state_dict, full_state_dict, load_from_checkpoint


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 10)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(10, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Holder(nn.Module):
    """What an FSDP2 script trains: the network under ``net``, as the LightningModule holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)


class LitNet(L.LightningModule):
    def __init__(self, width: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = Net()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def training_step(self, batch, batch_idx):
        return lm_loss(self, batch[0])

    def on_train_start(self) -> None:  # what the restore left, before the first step
        self.at_start = full_state_dict(self, rank0_only=False)
        self.optim_at_start = full_optimizer_state_dict(self, self.trainer.optimizers[0], rank0_only=False)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fsdp2_body(rank: int, world: int, folder: str, layout: str) -> None:
    """Two AdamW steps of plain FSDP2 (fully_shard per block and the root), then dcp.save as torchtitan
    or as Lightning's ModelParallelStrategy lays it out; rank 0 keeps FSDP2's full state dicts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Holder()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in make_batches(2, 4 * world):
        lm_loss(model, batch[rank::world]).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if layout == "modelparallel":
        state = {"state_dict": state["model"], "optimizer_0": state["optim"]}
    dcp.save(state, checkpoint_id=f"{folder}/ckpt")
    if layout == "modelparallel" and rank == 0:  # its meta.pt: Lightning's state
        lightning_state = {
            "pytorch-lightning_version": L.__version__,
            "global_step": 2,
            "epoch": 0,
            "lr_schedulers": [],
        }
        torch.save(lightning_state, f"{folder}/ckpt/meta.pt")
    everything = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_model = get_model_state_dict(model, options=everything)
    full_optim = get_optimizer_state_dict(model, optimizer, options=everything)
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, f"{folder}/fsdp2_full.pt")
    dist.barrier()


def _trainer_body(rank: int, world: int, folder: str) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    module = LitNet()
    trainer = quiet_trainer(strategy=FSDPCustomStrategy(auto_wrap_policy={Block}), devices=world, max_steps=1)
    loader = DataLoader(TensorDataset(make_batches(3, 2).reshape(6, -1)), batch_size=2)
    trainer.fit(module, loader, ckpt_path=f"{folder}/ckpt")
    return {"weights": module.at_start, "optim": module.optim_at_start, "log": records, "step": trainer.global_step}


def _fabric_body(rank: int, world: int, folder: str) -> dict:
    fabric = Fabric(strategy=FSDPCustomFabricStrategy(auto_wrap_policy={Block}), accelerator="cpu", devices=world)
    fabric.launch()
    model = fabric.setup_module(Holder())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    remainder = fabric.load(f"{folder}/ckpt", {"model": model, "optim": optimizer})
    return {
        "weights": full_state_dict(fabric.strategy.model, rank0_only=False),
        "optim": full_optimizer_state_dict(fabric.strategy.model, optimizer.optimizer, rank0_only=False),
        "remainder": remainder,
    }


def _assert_like_fsdp2(result: dict, oracle: dict) -> None:
    model, optim = oracle["model"], oracle["optim"]
    assert result["weights"].keys() == model.keys()
    assert all(torch.equal(result["weights"][key], value) for key, value in model.items())
    order = optim["param_groups"][0]["params"]  # FSDP2 names; ours: positions in the same order
    assert {order[p] for p in result["optim"]["state"]} == set(optim["state"])  # the same parameters have state
    for position, name in enumerate(order):
        if name not in optim["state"]:
            continue  # no gradient yet (Block.unused): no state on either side
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(result["optim"]["state"][position][key], optim["state"][name][key]), (name, key)
        assert float(result["optim"]["state"][position]["step"]) == 2.0


@pytest.mark.parametrize("layout", ["fsdp2", "modelparallel"])
def test_dcp_folders_written_by_others_load_at_another_world_size(tmp_path, layout):
    run_ranks(_fsdp2_body, 2, tmp_path, str(tmp_path), layout, env=LIGHTNING_ENV, timeout=300)
    oracle = torch.load(tmp_path / "fsdp2_full.pt", weights_only=False)
    trainer = run_ranks(_trainer_body, 3, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    _assert_like_fsdp2(
        {"weights": {k.removeprefix("net."): v for k, v in trainer["weights"].items()}, "optim": trainer["optim"]},
        {"model": {k.removeprefix("net."): v for k, v in oracle["model"].items()}, "optim": oracle["optim"]},
    )
    if layout == "fsdp2":  # no Lightning state: the loops start fresh, and it is said
        assert trainer["step"] == 1
        assert any("holds no Lightning state" in line and "start fresh" in line for line in trainer["log"])
    else:  # ModelParallelStrategy's meta.pt: Lightning's state, read as Lightning reads it
        assert not any("holds no Lightning state" in line for line in trainer["log"])
    if layout == "fsdp2":
        fabric = run_ranks(_fabric_body, 1, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
        _assert_like_fsdp2(fabric, oracle)
        assert fabric["remainder"] == {}


def _one_process_body(rank: int, world: int, folder: str) -> dict:
    module = LitNet(width=10)
    strategy = FSDPCustomStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")
    trainer = quiet_trainer(strategy=strategy, devices=world, max_steps=2)
    trainer.fit(module, DataLoader(TensorDataset(make_batches(2, 4).reshape(8, -1)), batch_size=2))
    trainer.save_checkpoint(f"{folder}/sharded.ckpt")
    return full_state_dict(module, rank0_only=False)


def test_a_sharded_folder_loads_into_a_plain_module_in_one_process(tmp_path):
    trained = run_ranks(_one_process_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300)[0]
    with pytest.raises(IsADirectoryError):  # Lightning's opens a file; docs/checkpoints.md names the call below
        LitNet.load_from_checkpoint(tmp_path / "sharded.ckpt")
    plain = load_from_checkpoint(LitNet, tmp_path / "sharded.ckpt")
    assert type(plain) is LitNet and plain.hparams.width == 10
    assert all(torch.equal(plain.state_dict()[key], value) for key, value in trained.items())
    assert not dist.is_initialized()
