"""Lightning's ``WeightAveraging`` callbacks (EMA, SWA averages) on the sharded model.

[Note: sharded weight averaging]
An average of weights is elementwise, so each rank averages its own shards exactly and no rank
ever holds a whole copy of the model. ``WeightAveraging`` builds its ``AveragedModel`` (a deep
copy of the LightningModule) in its ``setup``, before the strategy shards the model; the strategy
defers that (``defer``) and builds it after sharding (``build``) from a copy of the sharded
module: the same modules, with this rank's shards as parameters and the engine's hooks left
out. The callback then runs unchanged: ``update_parameters``, ``_swap_models`` and
``_copy_average_to_current`` zip ``parameters()`` and ``buffers()`` of the two, which are shards
on both sides outside a step. Checkpoints keep Lightning's layout: a full file holds the gathered
average under ``state_dict`` and the current model under ``current_model_state``; a sharded
folder holds the current model under DCP key ``model`` (as without averaging) and the average
under ``averaged_model``, each resharded on load like the model. Costs: the average's shards
(1/N of the model per rank, in the parameters' dtype), and one elementwise update per step.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import WeightAveraging
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel

from fsdp_strategy.checkpoint.sharded import checkpoint_view, dcp_reader
from fsdp_strategy.checkpoint.storage import Location
from fsdp_strategy.engine import SCHEDULER_ATTRIBUTE, control, get_scheduler
from fsdp_strategy.engine.view import ShardsView

AVERAGED_KEY = "averaged_model"  # DCP key of the average in a sharded folder
_STASHED = "_fsdp_custom_checkpoint"  # on a deferred callback: the checkpoint it was asked to load
_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def averaging_callbacks(trainer: pl.Trainer) -> list[WeightAveraging]:
    """The trainer's ``WeightAveraging`` callbacks."""
    return [c for c in trainer.callbacks if isinstance(c, WeightAveraging)]


def defer(callbacks: list[WeightAveraging]) -> None:
    """Make each callback's ``setup`` for fitting build nothing, and its ``on_load_checkpoint``
    keep the checkpoint for ``build`` (instance attributes, removed by ``restore``)."""
    for callback in callbacks:
        original_setup = type(callback).setup

        def setup(self: WeightAveraging, trainer: Any, pl_module: Any, stage: str, original: Any = original_setup):
            if stage != "fit":
                original(self, trainer, pl_module, stage)

        def on_load_checkpoint(self: WeightAveraging, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
            self.__dict__[_STASHED] = checkpoint

        callback.setup = types.MethodType(setup, callback)
        callback.on_load_checkpoint = types.MethodType(on_load_checkpoint, callback)


def restore(callbacks: list[WeightAveraging]) -> None:
    """Undo ``defer``: the callbacks behave as Lightning wrote them again."""
    for callback in callbacks:
        for name in ("setup", "on_load_checkpoint", _STASHED):
            callback.__dict__.pop(name, None)


def _without_engine(module: nn.Module) -> nn.Module:
    """A deep copy of the sharded ``module`` at rest: its shards as parameters, no engine hooks."""
    scheduler = get_scheduler(module)
    hooks = scheduler.hook_handles
    memo: dict[int, Any] = {id(scheduler): None}
    for layer in module.modules():  # the watchdog is not copied: the copy's SyncBatchNorm layers hold None
        if getattr(layer, "watchdog", None) is not None:
            memo[id(layer.watchdog)] = None
    for handle in hooks:
        for hooks_dict in (ref() for ref in _dict_refs(handle)):
            if hooks_dict is not None and handle.id in hooks_dict:
                memo[id(hooks_dict[handle.id])] = None
    duplicate = copy.deepcopy(module, memo)
    ids = {handle.id for handle in hooks}
    for part in duplicate.modules():
        for name in _HOOK_TABLES:
            table = getattr(part, name)
            for key in [key for key in table if key in ids]:
                del table[key]
    duplicate.__dict__.pop(SCHEDULER_ATTRIBUTE, None)
    return duplicate


def _dict_refs(handle: Any) -> tuple:
    refs = handle.hooks_dict_ref
    return refs if isinstance(refs, tuple) else (refs,)


def build(callback: WeightAveraging, module: nn.Module) -> None:
    """Give ``callback`` an ``AveragedModel`` of the sharded ``module`` ([Note: sharded weight
    averaging]) and load what a resumed checkpoint holds for it."""
    averaged = AveragedModel(nn.Identity(), use_buffers=callback._use_buffers, **callback._kwargs)
    averaged.module = _without_engine(module)
    if callback._device is not None:
        averaged = averaged.to(callback._device)
    callback._average_model = averaged
    checkpoint = callback.__dict__.pop(_STASHED, None)
    if checkpoint is not None and "averaging_state" in checkpoint:
        averaged.load_state_dict(checkpoint["averaging_state"], strict=False)


@torch.no_grad()
def copy_current(module: nn.Module, callback: WeightAveraging) -> None:
    """Start the average from the model as it is (a resumed checkpoint without an average)."""
    own = averaged_tensors(callback)
    ShardsView.of(module).before_host_writes()
    for name, value in module.state_dict(keep_vars=True).items():
        own[name].copy_(value.detach())


def averaged_tensors(callback: WeightAveraging) -> dict[str, torch.Tensor]:
    """The average's state dict (shards for sharded parameters), by the model's names."""
    assert callback._average_model is not None
    return callback._average_model.module.state_dict(keep_vars=True)


@torch.no_grad()
def full_average(module: nn.Module, callback: WeightAveraging, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The average gathered into full tensors on the CPU (rank 0 only with ``rank0_only``; a
    collective: every rank calls it). Costs: one all-gather per unit, one unit at a time."""
    view = ShardsView.of(module)
    own = averaged_tensors(callback)
    keep = not rank0_only or control.process_rank()[0] == 0
    gathered: dict[str, torch.Tensor] = {}
    for unit, params in view.unit_params():
        fulls = view.gather(unit, [own[p.fqn].detach() for p in params], keep)
        gathered.update({p.fqn: full for p, full in zip(params, fulls)})
    if not keep:
        return {}
    full = {}
    for name, value in module.state_dict(keep_vars=True).items():
        param = view.by_id.get(id(value))
        average = own[name].detach()
        saved = view.buffer_dtypes.get(name, average.dtype)
        full[name] = gathered[param.fqn] if param is not None else average.to("cpu", saved, copy=True)
    return full


def load_full_average(module: nn.Module, callback: WeightAveraging, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict into the average's shards: each rank takes its rows."""
    view = ShardsView.of(module)
    own = averaged_tensors(callback)
    view.before_host_writes()
    with torch.no_grad():
        for name, value in module.state_dict(keep_vars=True).items():
            if name not in state_dict:
                continue
            param = view.by_id.get(id(value))
            source = state_dict[name]
            own[name].copy_(param.shard_of_full(source) if param is not None else source)


def sharded_views(module: nn.Module, callback: WeightAveraging) -> dict[str, torch.Tensor]:
    """The average as the sharded checkpoint writes it (checkpoint views of its shards; buffers in
    their saved dtype)."""
    view = ShardsView.of(module)
    own = averaged_tensors(callback)
    views = {}
    for name, value in module.state_dict(keep_vars=True).items():
        param = view.by_id.get(id(value))
        average = own[name].detach()
        if param is not None:
            views[name] = checkpoint_view(param, average, view)
        else:
            views[name] = average.to(view.buffer_dtypes.get(name, average.dtype))
    return views


@torch.no_grad()
def load_sharded_average(folder: Location, module: nn.Module, callback: WeightAveraging) -> None:
    """Load a folder's average (DCP key ``averaged_model``) into the average's shards, resharded."""
    views = sharded_views(module, callback)
    ShardsView.of(module).before_host_writes()
    dcp.load({AVERAGED_KEY: views}, storage_reader=dcp_reader(folder))
    own = averaged_tensors(callback)
    for name, view in views.items():  # buffers held in another dtype were loaded into copies
        if not isinstance(view, DTensor) and view.data_ptr() != own[name].data_ptr():
            own[name].copy_(view)
