"""Full (unsharded) state dicts of a sharded model and its optimizer, gathered unit by unit.

``full_state_dict`` all-gathers one unit at a time and keeps the result on the CPU (on rank 0
only, by default), so the extra device memory is about one unit, not the model. Loading
goes the other way: each rank copies its own rows out of the full tensors. Optimizer state is in
torch's own layout (keyed by position), as every other Lightning strategy writes it.
Every function here is a collective: call it on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fsdp_strategy.checkpoint import layout, module_state, names, storage
from fsdp_strategy.checkpoint.layout import CheckpointError
from fsdp_strategy.checkpoint.storage import Location
from fsdp_strategy.engine import control
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.view import ShardsView


def _is_rank0() -> bool:
    return control.process_rank()[0] == 0


@torch.no_grad()
def full_state_dict(module: nn.Module | ShardsView, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with full parameters on the CPU (in their master dtype), under the keys
    its modules' own state-dict code gives ([Note: state dicts through the modules' own code]).

    With ``rank0_only`` the other ranks take part in the gathers and return ``{}``.
    Costs: one all-gather per unit; device memory of one unit at a time.
    """
    view = ShardsView.of(module)
    saved = module_state.saved_state(view)
    keep = not rank0_only or _is_rank0()
    full: dict[int, torch.Tensor] = {}
    for unit, params in view.unit_params():
        tensors = view.gather(unit, [p.sharded for p in params], keep)
        full.update({id(p.sharded): tensor for p, tensor in zip(params, tensors)})
    if not keep:
        return {}
    dtypes = view.saved_dtypes()  # [Note: buffers keep their dtype in checkpoints]
    state = {}
    for key, value in saved.items():
        if isinstance(value, ShardedParam):
            value = full[id(value.sharded)]
        elif torch.is_tensor(value):
            value = value.detach().to("cpu", dtypes.get(id(value), value.dtype), copy=True)
        state[key] = value
    return state


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module | ShardsView, state_dict: Mapping[str, Any], strict: bool = True, source: str = "state dict"
) -> None:
    """Copy a full state dict into the shards (each rank takes its rows), the buffers and any extra
    state, through the modules' own ``load_state_dict`` code ([Note: state dicts through the
    modules' own code]).

    Raises ``StrictLoadError`` (a ``RuntimeError``) naming ``source`` and the missing/unexpected keys
    (with ``strict``) or a key whose shape does not match; nothing is copied then.
    """
    view = ShardsView.of(module)
    plan = module_state.load_plan(view, state_dict, strict, source)
    view.before_host_writes()
    for key, params in plan.params.items():
        for param in params:
            param.sharded.copy_(param.shard_of_full(state_dict[key]))
    module_state.load_plain(view, state_dict, plan)


@torch.no_grad()
def full_optimizer_state_dict(
    module: nn.Module | ShardsView, optimizer: torch.optim.Optimizer, rank0_only: bool = True
) -> dict[str, Any]:
    """The optimizer's state with full tensors in torch's own layout (a collective).

    What ``optimizer.state_dict()`` of the same optimizer over the unsharded model returns:
    state keyed by parameter position, ``param_groups`` listing positions, so DDP, a single
    device and Lightning's FSDP load it unchanged. Shard-shaped state (Adam's moments) is
    gathered unit by unit like the parameters; other state (``step``) is taken as is.
    """
    view = ShardsView.of(module)
    keep = not rank0_only or _is_rank0()
    owners = names.optimizer_owners(view)
    position = {
        id(p.sharded): i for i, p in enumerate(p for group in names.optimizer_params(optimizer, owners) for p in group)
    }
    per_param = {id(p): state for p, state in optimizer.state.items()}
    apart = view.apart_keys(optimizer)  # an owner's state of the shard's shape is no row shard
    out_state: dict[int, dict[str, Any]] = {}
    for unit, params in view.unit_params():
        states = [per_param.get(id(p.sharded), {}) for p in params]
        keys = sorted(
            {
                k
                for p, s in zip(params, states)
                for k, v in s.items()
                if _shard_shaped(v, p, apart.get(id(p.sharded)), k)
            }
        )
        for key in keys:  # a gather takes every parameter of the unit: zeros where one has no such state
            shards = [
                s[key] if key in s else torch.zeros_like(p.sharded, dtype=torch.float32) for p, s in zip(params, states)
            ]
            for p, s, full in zip(params, states, view.gather(unit, shards, keep)):
                if key in s and id(p.sharded) in position:
                    out_state.setdefault(position[id(p.sharded)], {})[key] = full
        if keep:
            for p, s in zip(params, states):
                for key, value in s.items():
                    if key not in keys and id(p.sharded) in position:
                        out_state.setdefault(position[id(p.sharded)], {})[key] = _copied(value)
    _gather_held_apart(view, optimizer, position, out_state, rank0_only)
    if not keep:
        return {}
    for owner in owners.values():  # whole parameters ([Note: ignored modules]): their state as is
        if isinstance(owner, names.WholeParam) and id(owner.sharded) in position:
            state = per_param.get(id(owner.sharded), {})
            entry = {key: _copied(value) for key, value in state.items()}
            if entry:
                out_state[position[id(owner.sharded)]] = entry
    return {"state": dict(sorted(out_state.items())), "param_groups": names.torch_groups(optimizer)}


def _gather_held_apart(
    view: ShardsView, optimizer: torch.optim.Optimizer, position: dict[int, int], out: dict, rank0_only: bool
) -> None:
    """Add the state each rank alone holds (an owner's, [Note: whole-matrix placement]) to ``out``, on
    rank 0 (every rank unless ``rank0_only``). A collective; costs one object gather of that state."""
    mine = {position[i]: _copied(entries) for i, entries in view.held_apart(optimizer).items() if i in position}
    parts = (
        control.gather_objects(mine, dog=view.watchdog)
        if rank0_only
        else control.all_gather_objects(mine, dog=view.watchdog)
    )
    for part in parts or []:
        for index, entries in part.items():
            out.setdefault(index, {}).update(entries)


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it copied to the CPU (lists, tuples and dicts rebuilt): a saved
    state must not change with the optimizer's next step (SOAP updates its lists in place)."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _shard_shaped(value: Any, param: ShardedParam, apart: set[str] | None = None, key: str = "") -> bool:
    return torch.is_tensor(value) and value.shape == param.sharded.shape and key not in (apart or ())


@torch.no_grad()
def load_full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], source: Any = "optimizer state"
) -> None:
    """Load a full optimizer state into ``optimizer``, each rank taking its rows.

    Accepts torch's layout keyed by position (ours, DDP's, a single device's, Lightning FSDP's
    full files) and keyed by parameter name (FSDP's, Lightning's consolidated folders, our
    format-1 files): see ``names.py``.
    """
    view = ShardsView.of(module)
    rows = names.load_state(optimizer, names.optimizer_owners(view), state_dict, source, cut_rows=True)
    view.loaded_state(optimizer, rows)


def load_full_checkpoint(
    path: str | os.PathLike | Location,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a full checkpoint file into the shards (and the optimizers); return Lightning's rest.

    Every rank reads the file (memory-mapped) and copies out its own rows, so it loads at any
    world size. ``weights_only`` as ``torch.load``'s. Errors name the file and the key.
    """
    checkpoint = load_file(path, weights_only)
    apply_full_checkpoint(checkpoint, module, optimizers, strict, path)
    checkpoint.pop("state_dict")
    return checkpoint


def apply_full_checkpoint(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool, path: Any
) -> None:
    """Copy a read full checkpoint's weights (and optimizer states, if ``optimizers``) into the shards;
    everything is checked before anything is copied: a failed load changes nothing."""
    if "state_dict" not in checkpoint:
        raise CheckpointError(f"{path}: key 'state_dict' is missing; not a Lightning checkpoint")
    states = _optimizer_states(checkpoint, module, optimizers, path) if optimizers else None
    load_full_state_dict(module, checkpoint["state_dict"], strict=strict, source=str(path))
    for optimizer, state in zip(optimizers, states or []):
        load_full_optimizer_state_dict(module, optimizer, state, source=path)


def load_full_optimizers(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: list[torch.optim.Optimizer], path: Any
) -> None:
    """Load a read full checkpoint's optimizer states (``optimizer_states``, in order) into ``optimizers``."""
    for optimizer, state in zip(optimizers, _optimizer_states(checkpoint, module, optimizers, path) or []):
        load_full_optimizer_state_dict(module, optimizer, state, source=path)


def _optimizer_states(
    checkpoint: dict[str, Any], module: nn.Module, optimizers: list[torch.optim.Optimizer], path: Any
) -> list[dict[str, Any]] | None:
    """The checkpoint's optimizer states, checked against ``optimizers`` (count, parameters); None if it holds none."""
    states = checkpoint.get("optimizer_states")
    if states is None:
        return None
    if len(states) != len(optimizers):
        raise CheckpointError(
            f"{path}: key 'optimizer_states' holds {len(states)} optimizers, the model configures {len(optimizers)}"
        )
    owners = names.optimizer_owners(module)
    for optimizer, state in zip(optimizers, states):
        names.resolve_ids(optimizer, owners, state.get("param_groups", []), path)
    return states


def load_file(path: str | os.PathLike | Location, weights_only: bool | None = None) -> dict[str, Any]:
    """Read a full checkpoint file on the CPU, memory-mapped on a local disk (``weights_only`` as
    ``torch.load``'s: None is torch's default); a file that is not one is named in the error."""
    where = storage.locate(path)
    if not storage.exists(where):
        raise FileNotFoundError(f"checkpoint {str(where)!r} does not exist")
    if storage.isdir(where):
        raise CheckpointError(
            f"{str(where)!r} is a folder (a sharded checkpoint, or none), but a full checkpoint file is expected"
        )
    return layout.load_object(where, weights_only, mmap=True)
