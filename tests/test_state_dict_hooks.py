"""Checkpoints go through each module's own state-dict code, as ``nn.Module.load_state_dict`` and
``state_dict`` do: a layer that renames keys on load (LitGPT's LoRA layers load a base model's
``qkv.weight`` into ``qkv.linear.weight``) and one that adds an entry on save round-trip exactly,
in full and sharded checkpoints, under Fabric (``save``/``load``/``load_raw``) and the Trainer; the
oracle is the same model unsharded, through torch's own ``load_state_dict``."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from dist_utils import run_ranks
from lightning.fabric import Fabric
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomFabricStrategy, FSDPCustomStrategy
from fsdp_strategy.checkpoint import CheckpointError, StrictLoadError, full_state_dict


class Adapted(nn.Module):
    """A linear layer behind an adapter (LoRA's shape): its weight is ``linear.weight``, and a base
    checkpoint's ``weight``/``bias`` are loaded into it by ``_load_from_state_dict``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.adapter = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.adapter

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[prefix + "linear." + name] = state_dict.pop(prefix + name)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class Versioned(nn.Module):
    """A layer whose state dict carries an extra entry (a post hook adds ``version``, a load pre
    hook takes it back) and whose extra state is a dict (``get_extra_state``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.version = torch.tensor(0)
        self.notes = {"steps": 0}
        self.register_state_dict_post_hook(self._add_version)
        self.register_load_state_dict_pre_hook(self._take_version)

    @staticmethod
    def _add_version(module, state_dict, prefix, local_metadata):
        state_dict[prefix + "version"] = module.version.clone()

    def _take_version(self, module, state_dict, prefix, *args):
        if prefix + "version" in state_dict:
            self.version = state_dict.pop(prefix + "version").clone()

    def get_extra_state(self):
        return dict(self.notes)

    def set_extra_state(self, state):
        self.notes = dict(state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Net(nn.Module):
    def __init__(self, width: int = 10) -> None:
        super().__init__()
        self.first = Adapted(width)
        self.middle = Versioned(width)
        self.last = Adapted(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.last(torch.relu(self.middle(self.first(x)))))


UNITS = {Adapted, Versioned}


def _base_state(seed: int) -> dict[str, torch.Tensor]:
    """A checkpoint of the model without adapters, in the base layout (``first.weight``, ...)."""
    torch.manual_seed(seed)
    plain = Net()
    state = {}
    for key, value in plain.state_dict().items():
        if key.endswith("adapter") or key.endswith("_extra_state") or key.endswith("version"):
            continue
        state[key.replace("linear.", "")] = value
    return state


def _expected_after_base_load(base: dict) -> dict[str, torch.Tensor]:
    """What torch's own load_state_dict makes of the base checkpoint (the oracle)."""
    torch.manual_seed(1)
    plain = Net()
    plain.load_state_dict(base, strict=False)
    return plain.state_dict()


def _equal(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(
        torch.equal(got[k], expected[k]) if torch.is_tensor(expected[k]) else got[k] == expected[k] for k in expected
    )


def _fabric(world: int, policy: set | None = UNITS, kind: str = "sharded") -> Fabric:
    strategy = FSDPCustomFabricStrategy(auto_wrap_policy=policy, state_dict_type=kind)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world)
    fabric.launch()
    return fabric


def _fabric_body(rank: int, world: int, folder: str) -> dict:
    result = {}
    base = _base_state(0)
    if rank == 0:
        torch.save(base, f"{folder}/base.pt")
    for policy in (UNITS, None):  # per-layer units and the default (the whole model one unit)
        fabric = _fabric(world, policy)
        fabric.barrier()
        torch.manual_seed(1)
        model = fabric.setup_module(Net())
        fabric.load_raw(f"{folder}/base.pt", model, strict=False)  # LoRA's case: renamed on load
        loaded = full_state_dict(model, rank0_only=False)
        result[f"load_raw per layer: {policy is not None}"] = _equal(loaded, _expected_after_base_load(base))
        try:
            fabric.load_raw(f"{folder}/base.pt", model, strict=True)
        except RuntimeError as error:  # torch's type: code that catches RuntimeError catches it
            result["strict"] = (type(error).__name__, str(error))
    for kind in ("full", "sharded"):
        fabric = _fabric(world, UNITS, kind)
        model = fabric.setup_module(Net())
        model.middle.version = torch.tensor(7)
        model.middle.notes = {"steps": 5}
        before = full_state_dict(model, rank0_only=False)
        fabric.save(f"{folder}/{kind}", {"model": model})
        torch.manual_seed(2)
        other = fabric.setup_module(Net())
        fabric.load(f"{folder}/{kind}", {"model": other})
        after = full_state_dict(other, rank0_only=False)
        result[kind] = (_equal(after, before), int(other.middle.version), other.middle.notes)
    return result


def test_fabric_checkpoints_go_through_the_modules_own_state_dict_code(tmp_path):
    for result in run_ranks(_fabric_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=300):
        # the renamed base weights were loaded, as torch's own load_state_dict loads them
        assert result["load_raw per layer: True"] and result["load_raw per layer: False"]
        name, message = result["strict"]
        assert name == "StrictLoadError" and "keys missing from it" in message and "first.adapter" in message
        for kind in ("full", "sharded"):
            assert result[kind] == (True, 7, {"steps": 5}), kind  # the extra entry and extra state came back


class LitNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer_body(rank: int, world: int, folder: str, kind: str) -> dict:
    torch.manual_seed(0)
    module = LitNet()
    module.net.middle.version = torch.tensor(4)
    module.net.middle.notes = {"steps": 9}
    strategy = FSDPCustomStrategy(auto_wrap_policy=UNITS, state_dict_type=kind)
    data = DataLoader(TensorDataset(torch.randn(8, 10)), batch_size=2)
    trainer = quiet_trainer(strategy=strategy, devices=world, max_steps=2, default_root_dir=folder)
    trainer.fit(module, data)
    trainer.save_checkpoint(f"{folder}/{kind}.ckpt")
    saved = full_state_dict(module, rank0_only=False)
    torch.manual_seed(3)
    resumed = LitNet()
    trainer = quiet_trainer(
        strategy=FSDPCustomStrategy(auto_wrap_policy=UNITS, state_dict_type=kind), devices=world, max_steps=2
    )
    trainer.fit(resumed, data, ckpt_path=f"{folder}/{kind}.ckpt")  # nothing left to train: the restore only
    return {
        "equal": _equal(full_state_dict(resumed, rank0_only=False), saved),
        "version": int(resumed.net.middle.version),
        "notes": resumed.net.middle.notes,
    }


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_trainer_checkpoints_go_through_the_modules_own_state_dict_code(tmp_path, kind):
    result = run_ranks(_trainer_body, 2, tmp_path, str(tmp_path), kind, env=LIGHTNING_ENV, timeout=300)[0]
    assert result == {"equal": True, "version": 4, "notes": {"steps": 9}}


def test_a_value_computed_from_parameters_on_save_or_load_is_refused(tmp_path):
    """What cannot run on shards is an error naming the key, never a silent approximation."""

    class Doubled(Net):
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            super()._save_to_state_dict(destination, prefix, keep_vars)
            destination[prefix + "doubled"] = self.head.weight * 2

    class Transposed(Net):
        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            if prefix + "head.weight" in state_dict:
                state_dict[prefix + "head.weight"] = state_dict[prefix + "head.weight"].t().t().contiguous() * 1
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    from fsdp_strategy.checkpoint import load_full_state_dict
    from fsdp_strategy.engine import shard_model

    doubled = shard_model(Doubled(), auto_wrap_policy=UNITS)
    with pytest.raises(CheckpointError, match="computes 'doubled' from its parameters"):
        full_state_dict(doubled)
    transposed = shard_model(Transposed(), auto_wrap_policy=UNITS)
    state = copy.deepcopy(Net().state_dict())
    with pytest.raises(CheckpointError, match="fills parameter 'head.weight' with something other than one checkpoint"):
        load_full_state_dict(transposed, state)
    with pytest.raises(StrictLoadError, match="size mismatch for head.weight"):
        load_full_state_dict(shard_model(Net(), auto_wrap_policy=UNITS), {**state, "head.weight": torch.zeros(4, 10)})
    assert Path(tmp_path).exists()
