"""Checkpoints a Lightning user switching strategies relies on: DDP / single-device /
Lightning-FSDP checkpoints resume here with their optimizer state; our full files resume under
DDP; Lightning's own consolidation of our sharded folders resumes under DDP; strict_loading=False
and weights_only are honoured. The oracle is Lightning's "ddp" run on the same data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from test_resume import PER_RANK, ScheduledLM, _data
from test_strategy import LIGHTNING_ENV, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from fsdp_strategy import FSDPCustomStrategy
from fsdp_strategy.checkpoint import CheckpointError, full_optimizer_state_dict, full_state_dict

DDP = "ddp_find_unused_parameters_true"  # TiedLM has a block that is never called


def _run(world: int, root: Path, strategy, max_steps: int, ckpt_path=None, module=None, saving_to=None, **fit_kwargs):
    """Fit ScheduledLM, saving at step 4 into ``saving_to`` (default ``root``); the mean losses."""
    torch.manual_seed(1 if ckpt_path else 0)  # a resumed run starts from other weights: they must load
    module = module or ScheduledLM()
    saver = ModelCheckpoint(dirpath=saving_to or root, every_n_train_steps=4, save_top_k=-1)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=world,
        max_steps=max_steps,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[saver, *fit_kwargs.pop("callbacks", [])],
        default_root_dir=root,
    )
    loader = DataLoader(TensorDataset(_data()), batch_size=PER_RANK)
    trainer.fit(module, loader, ckpt_path=ckpt_path, **fit_kwargs)
    losses = torch.stack(module.losses) if module.losses else torch.zeros(0)
    dist.all_reduce(losses)
    return (losses / world).tolist(), trainer


def _fsdp(state_dict_type: str = "full") -> FSDPCustomStrategy:
    return FSDPCustomStrategy(state_dict_type=state_dict_type)


def _lightning_fsdp_folder(checkpoint_file: Path, folder: Path) -> None:
    """What Lightning's FSDPStrategy(state_dict_type="sharded") writes (DCP keys ``model`` and
    ``optimizer_0`` keyed by parameter name, the rest in ``meta.pt``), made from a plain checkpoint:
    its FSDP1 needs CUDA, and the layout is all that matters here."""
    import torch.distributed.checkpoint as dcp

    checkpoint = torch.load(checkpoint_file, weights_only=False)
    plain = ScheduledLM()
    names = {id(p): n for n, p in plain.named_parameters()}
    optimizer = plain.configure_optimizers()[0][0]
    name_of = dict(enumerate(names[id(p)] for g in optimizer.param_groups for p in g["params"]))
    saved = checkpoint.pop("optimizer_states")[0]
    optim = {
        "state": {name_of[i]: v for i, v in saved["state"].items()},
        "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
    dcp.save({"model": checkpoint.pop("state_dict"), "optimizer_0": optim}, checkpoint_id=folder, no_dist=True)
    torch.save(checkpoint, folder / "meta.pt")


def _assert_states_equal(restored: dict, saved: dict) -> None:
    assert restored.keys() == saved.keys()
    for key, value in saved.items():
        if isinstance(value, dict):
            _assert_states_equal(restored[key], value)
        elif torch.is_tensor(value):
            assert torch.equal(restored[key], value), key
        else:
            assert restored[key] == value, key


def _interop_body(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    oracle, _ = _run(world, root / "ddp", DDP, 6)  # saves ddp/epoch=0-step=4.ckpt (the end of epoch 0)
    ddp_file = root / "ddp" / "epoch=0-step=4.ckpt"
    result: dict = {"oracle": oracle[4:]}

    # DDP's file (torch's optimizer layout, keyed by position) loads exactly, optimizer included
    _, trainer = _run(world, root / "restored", _fsdp(), 4, ckpt_path=str(ddp_file))
    model, optimizer = trainer.strategy.model, trainer.optimizers[0]
    restored = {"state_dict": full_state_dict(model), "optimizer": full_optimizer_state_dict(model, optimizer)}
    if rank == 0:
        saved = torch.load(ddp_file, weights_only=True)
        _assert_states_equal(restored["state_dict"], saved["state_dict"])
        _assert_states_equal(restored["optimizer"], saved["optimizer_states"][0])
    result["from_ddp"], _ = _run(world, root / "from_ddp", _fsdp(), 6, ckpt_path=str(ddp_file))

    # a folder in Lightning FSDP's sharded layout resumes too
    lightning_folder = root / "lightning_fsdp.ckpt"
    if rank == 0:
        _lightning_fsdp_folder(ddp_file, lightning_folder)
    dist.barrier()
    result["from_lightning_fsdp"], _ = _run(world, root / "from_lf", _fsdp(), 6, ckpt_path=str(lightning_folder))

    # our full file resumes under DDP; our sharded folder, consolidated by Lightning's utility, too
    _run(world, root / "ours_full", _fsdp("full"), 4)
    result["ddp_from_full"], _ = _run(world, root / "d1", DDP, 6, ckpt_path=str(root / "ours_full/epoch=0-step=4.ckpt"))
    _run(world, root / "ours_sharded", _fsdp("sharded"), 4)
    consolidated = root / "lightning_consolidated.ckpt"
    if rank == 0:
        from lightning.fabric.utilities.load import _load_distributed_checkpoint
        from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

        folder = root / "ours_sharded/epoch=0-step=4.ckpt"
        torch.save(_format_checkpoint(_load_distributed_checkpoint(folder)), consolidated)
    dist.barrier()
    result["ddp_from_lightning_consolidated"], _ = _run(world, root / "d2", DDP, 6, ckpt_path=str(consolidated))
    return result


def test_checkpoints_move_between_ddp_lightning_fsdp_and_fsdp_custom(tmp_path):
    result = run_ranks(_interop_body, 2, tmp_path, str(tmp_path), env=LIGHTNING_ENV, timeout=400)[0]
    oracle = result["oracle"]
    assert len(oracle) == 2
    for name in ("from_ddp", "from_lightning_fsdp", "ddp_from_full", "ddp_from_lightning_consolidated"):
        assert result[name] == pytest.approx(oracle, rel=1e-5, abs=1e-6), name


class _Opaque:
    """A class torch's weights_only unpickler refuses."""

    def __init__(self) -> None:
        self.value = 3


class _OpaqueState(Callback):
    def state_dict(self) -> dict:
        return {"opaque": _Opaque()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict["opaque"].value


class _ExtendedLM(ScheduledLM):
    """ScheduledLM with one more layer, loaded from checkpoints of ScheduledLM with strict_loading=False."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(3, 3)
        self.strict_loading = False


def _loading_body(rank: int, world: int, root: str, state_dict_type: str) -> dict:
    root = Path(root)
    _, saver = _run(world, root / "a", _fsdp(state_dict_type), 4, callbacks=[_OpaqueState()])
    ckpt = str(root / "a/epoch=0-step=4.ckpt")
    saved = full_state_dict(saver.strategy.model)
    result: dict = {}
    try:
        _run(
            world, root / "b", _fsdp(state_dict_type), 4, ckpt_path=ckpt, callbacks=[_OpaqueState()], weights_only=True
        )
    except CheckpointError as error:
        result["weights_only_error"] = str(error)
    for weights_only in (None, False):  # None (not given): False, as Lightning's FSDP loads its own
        callback = _OpaqueState()
        folder = root / f"c{weights_only}"
        _run(world, folder, _fsdp(state_dict_type), 4, ckpt_path=ckpt, callbacks=[callback], weights_only=weights_only)
        result[f"callback_loaded_{weights_only}"] = callback.loaded

    loaded = _validate(world, _ExtendedLM(), state_dict_type, ckpt)  # optimizers differ: as with DDP, weights only
    result["shared_equal"] = rank != 0 or all(torch.equal(loaded[k], v) for k, v in saved.items())
    strict = _ExtendedLM()
    strict.strict_loading = True
    try:
        _validate(world, strict, state_dict_type, ckpt)
    except CheckpointError as error:
        result["strict_error"] = str(error)
    return result


def _validate(world: int, module: ScheduledLM, state_dict_type: str, ckpt: str) -> dict:
    trainer = quiet_trainer(strategy=_fsdp(state_dict_type), devices=world, limit_val_batches=1)
    loader = DataLoader(TensorDataset(_data()), batch_size=PER_RANK)
    trainer.validate(module, loader, ckpt_path=ckpt, verbose=False, weights_only=False)
    return full_state_dict(trainer.strategy.model)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_weights_only_and_strict_loading_are_honoured(tmp_path, state_dict_type):
    result = run_ranks(_loading_body, 2, tmp_path, str(tmp_path), state_dict_type, env=LIGHTNING_ENV, timeout=300)[0]
    assert "weights_only" in result["weights_only_error"] and "_Opaque" in result["weights_only_error"]
    assert result["callback_loaded_None"] == result["callback_loaded_False"] == 3
    assert result["shared_equal"]
    assert "keys missing from it ['extra.bias', 'extra.weight']" in result["strict_error"]
