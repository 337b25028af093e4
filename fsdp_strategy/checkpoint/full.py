"""Full (unsharded) state dicts of a sharded model and its optimizer, gathered unit by unit.

``full_state_dict`` all-gathers one unit at a time and keeps the result on the CPU (on rank 0
only, by default), so the extra device memory is about one unit, not the model. Loading
goes the other way: each rank copies its own rows out of the full tensors. Optimizer state is
keyed by parameter name, so it does not depend on the order in which parameters were given.
Every function here is a collective: call it on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_strategy.checkpoint import names
from fsdp_strategy.checkpoint.layout import CheckpointError
from fsdp_strategy.engine import collectives, get_scheduler
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.unit import FSDPUnit


def _is_rank0() -> bool:
    return collectives.process_rank()[0] == 0


def _gather_unit(unit: FSDPUnit, shards: list[torch.Tensor], keep: bool) -> list[torch.Tensor]:
    fulls = unit.gather_full(shards, keep=keep)  # fresh tensors (copied out of the gather buffer)
    return [full.to("cpu") for full in fulls]


@torch.no_grad()
def full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with full parameters on the CPU (in their master dtype).

    With ``rank0_only`` the other ranks take part in the gathers and return ``{}``.
    Costs: one all-gather per unit; device memory of one unit at a time.
    """
    scheduler = get_scheduler(module)
    keep = not rank0_only or _is_rank0()
    full: dict[int, torch.Tensor] = {}
    for unit in scheduler.units:
        tensors = _gather_unit(unit, [p.sharded for p in unit.params], keep)
        full.update({id(p.sharded): tensor for p, tensor in zip(unit.params, tensors)})
    if not keep:
        return {}
    return {
        name: full[id(value)] if id(value) in full else value.detach().cpu().clone()
        for name, value in module.state_dict(keep_vars=True).items()
    }


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, source: str = "state dict"
) -> None:
    """Copy a full state dict into the shards (each rank takes its rows) and the buffers.

    Raises CheckpointError naming ``source`` and the missing/unexpected keys (with ``strict``)
    or a key whose shape does not match; nothing is copied then.
    """
    scheduler = get_scheduler(module)
    prefixes = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    by_name = {
        f"{prefixes[id(use.module)]}.{use.name}".lstrip("."): p for p in scheduler.sharded_params() for use in p.uses
    }
    own = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{source}: checkpoint of another model: keys missing from it {missing}, unexpected keys {unexpected}"
        )
    for name, value in state_dict.items():
        if name not in own:
            continue
        shape = by_name[name].shape if name in by_name else own[name].shape
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"{source}: key {name!r} has shape {tuple(value.shape)} in the checkpoint, {tuple(shape)} in the model"
            )
    for name, value in state_dict.items():
        if name not in own:
            continue
        param = by_name.get(name)
        if param is not None:
            param.sharded.copy_(param.local_rows(value, param.shard_rank))
        else:
            own[name].copy_(value)


@torch.no_grad()
def full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = True
) -> dict[str, Any]:
    """The optimizer's state with full tensors, keyed by parameter name (a collective).

    Shard-shaped state (e.g. Adam's moments) is gathered unit by unit like the parameters;
    other state (e.g. ``step``) is taken as is.
    """
    scheduler = get_scheduler(module)
    keep = not rank0_only or _is_rank0()
    per_param = {id(p): state for p, state in optimizer.state.items()}
    out_state: dict[str, dict[str, Any]] = {}
    gathered: dict[str, list[str]] = {}
    for unit in scheduler.units:
        states = [per_param.get(id(p.sharded), {}) for p in unit.params]
        keys = sorted({k for p, s in zip(unit.params, states) for k, v in s.items() if _shard_shaped(v, p)})
        for key in keys:
            shards = [
                s[key] if key in s else torch.zeros_like(p.sharded, dtype=torch.float32)
                for p, s in zip(unit.params, states)
            ]
            for p, s, full in zip(unit.params, states, _gather_unit(unit, shards, keep)):
                if key in s:
                    out_state.setdefault(p.fqn, {})[key] = full
                    gathered.setdefault(p.fqn, []).append(key)
        if keep:
            for p, s in zip(unit.params, states):
                for key, value in s.items():
                    if key not in keys:
                        out_state.setdefault(p.fqn, {})[key] = value.clone() if torch.is_tensor(value) else value
    if not keep:
        return {}
    groups = names.named_groups(optimizer, names.shard_owners(module))
    return {"state": out_state, "param_groups": groups, "gathered_keys": gathered}


def _shard_shaped(value: Any, param: ShardedParam) -> bool:
    return torch.is_tensor(value) and value.shape == param.sharded.shape


@torch.no_grad()
def load_full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], source: Any = "optimizer state"
) -> None:
    """Load a name-keyed full optimizer state into ``optimizer`` (each rank takes its rows)."""
    owners = names.shard_owners(module)
    names.check_names(optimizer, owners, state_dict["state"], source)
    by_fqn = {p.fqn: p for p in owners.values()}
    gathered = state_dict.get("gathered_keys", {})
    local = {
        fqn: {
            key: by_fqn[fqn].local_rows(value, by_fqn[fqn].shard_rank) if key in gathered.get(fqn, ()) else value
            for key, value in entry.items()
        }
        for fqn, entry in state_dict["state"].items()
    }
    names.load_named_state(optimizer, owners, local, state_dict["param_groups"], source)


def load_full_checkpoint(
    path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Load a full checkpoint file into the shards (and the optimizers); return Lightning's rest.

    Every rank reads the file (memory-mapped) and copies out its own rows, so it loads at any
    world size. Errors name the file and the key.
    """
    checkpoint = load_file(path)
    if "state_dict" not in checkpoint:
        raise CheckpointError(f"{path}: key 'state_dict' is missing; not a Lightning checkpoint")
    load_full_state_dict(module, checkpoint.pop("state_dict"), strict=strict, source=str(path))
    optimizer_states = checkpoint.get("optimizer_states")
    if optimizer_states is None or not optimizers:
        return checkpoint
    if len(optimizer_states) != len(optimizers):
        raise CheckpointError(
            f"{path}: key 'optimizer_states' holds {len(optimizer_states)} optimizers, the model configures "
            f"{len(optimizers)}"
        )
    for optimizer, state in zip(optimizers, optimizer_states):
        load_full_optimizer_state_dict(module, optimizer, state, source=path)
    return checkpoint


def load_file(path: Path) -> dict[str, Any]:
    """Read a full checkpoint file on the CPU; a file that is not one is named in the error."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # torch raises several types for damaged zip/pickle data
        raise CheckpointError(f"{path}: not a readable checkpoint file ({type(error).__name__}: {error})") from None
