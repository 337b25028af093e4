"""Optimizer state in torch's layout: what full and sharded checkpoints share.

torch's ``optimizer.state_dict()`` keys per-parameter state by the ids listed in
``param_groups[i]["params"]``: positions for a plain optimizer (what DDP, a single device and
Lightning's FSDP write into full files, and what our full files hold), parameter names for
FSDP's ``optim_state_dict`` (what sharded folders hold, Lightning's FSDP ones included). A
saved id is resolved to one of this optimizer's parameters by name when every id is a name,
else by position, group by group.

[Note: full-shaped optimizer state]
A per-parameter state tensor of the full parameter's shape (Adam's moments, SGD's momentum)
is sharded like the parameter: each rank keeps its rows. Anything else (``step``) is kept
whole on every rank. A 0-dim parameter's state is 0-dim too, like ``step``: there only
``step`` is kept whole (torch's optimizers name their counter so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fsdp_strategy.checkpoint.layout import CheckpointError, shortened
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.view import ShardsView


class WholeParam:
    """A parameter the engine does not shard ([Note: ignored modules]): every rank holds it whole,
    so its optimizer state is saved and loaded as is. Quacks like ShardedParam for this module."""

    shard_rank = 0

    def __init__(self, fqn: str, param: nn.Parameter) -> None:
        self.fqn = fqn
        self.sharded = param
        self.shape = self.global_shape = param.shape

    def shard_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """The whole tensor: every rank holds all of it."""
        return full


def optimizer_owners(model: nn.Module | ShardsView) -> dict[int, ShardedParam | WholeParam]:
    """``id(parameter) -> its ShardedParam`` for every sharded parameter, plus the parameters of
    ignored modules (as ``WholeParam``), which optimizers hold too."""
    view = ShardsView.of(model)
    owners: dict[int, ShardedParam | WholeParam] = dict(view.by_id)
    owners.update({id(p): WholeParam(name, p) for name, p in view.ignored_params.items()})
    return owners


def optimizer_params(optimizer: torch.optim.Optimizer, owners: Mapping[int, ShardedParam]) -> list[list[ShardedParam]]:
    """The optimizer's parameters, group by group, as ShardedParams (a parameter we do not shard is an error)."""
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in owners]
        if missing:
            raise ValueError(
                f"optimizer param group {index} holds tensors that are not parameters of the sharded model "
                f"(shapes {missing}); build the optimizer from the LightningModule's parameters after setup"
            )
        groups.append([owners[id(p)] for p in group["params"]])
    return groups


def torch_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups as ``optimizer.state_dict()`` writes them: parameters by position."""
    groups, position = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(position, position + count))}
        )
        position += count
    return groups


def named_groups(optimizer: torch.optim.Optimizer, owners: Mapping[int, ShardedParam]) -> list[dict[str, Any]]:
    """The param groups with parameter names as ids (FSDP's ``optim_state_dict`` layout)."""
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [p.fqn for p in params]}
        for group, params in zip(optimizer.param_groups, optimizer_params(optimizer, owners))
    ]


def check_group_count(saved: int, optimizer: torch.optim.Optimizer, source: Any) -> None:
    """A checkpoint's optimizer state of ``saved`` param groups fits ``optimizer`` only with as many:
    else a ``CheckpointError`` whose first words are the likely cause."""
    if saved != len(optimizer.param_groups):
        raise CheckpointError(
            f"{source}: was it trained with another optimizer? Its optimizer state has {saved} param groups, this "
            f"run's {type(optimizer).__name__} has {len(optimizer.param_groups)} (another optimizer or another "
            "grouping of the parameters, e.g. the examples' optimizer.name); nothing was loaded"
        )


def resolve_ids(
    optimizer: torch.optim.Optimizer, owners: Mapping[int, ShardedParam], saved_groups: list[dict], source: Any
) -> dict[Any, ShardedParam]:
    """``saved id -> ShardedParam``: by name when every saved id is a string, else by position."""
    held = optimizer_params(optimizer, owners)
    check_group_count(len(saved_groups), optimizer, source)
    saved_ids = [i for group in saved_groups for i in group["params"]]
    if saved_ids and all(isinstance(i, str) for i in saved_ids):
        by_name = {p.fqn: p for params in held for p in params}
        unknown = sorted(set(saved_ids) - set(by_name))
        if unknown:
            raise CheckpointError(
                f"{source}: checkpoint of another model? It has optimizer state for {len(unknown)} parameters this "
                f"optimizer does not hold: {shortened(unknown)}"
            )
        return {i: by_name[i] for i in saved_ids}
    mapping = {}
    for index, (group, params) in enumerate(zip(saved_groups, held)):
        if len(group["params"]) != len(params):
            raise CheckpointError(
                f"{source}: optimizer param group {index} holds {len(group['params'])} parameters in the checkpoint, "
                f"{len(params)} in the optimizer (a checkpoint of another model, or the optimizer is built differently)"
            )
        mapping.update(zip(group["params"], params))
    return mapping


def is_full_shaped(param: ShardedParam, key: str, shape: tuple) -> bool:
    """Whether a saved state tensor is sharded like its parameter ([Note: full-shaped optimizer state])."""
    return tuple(shape) == tuple(param.global_shape) and not (param.shape == torch.Size([]) and key == "step")


def load_state(
    optimizer: torch.optim.Optimizer,
    owners: Mapping[int, ShardedParam],
    state_dict: Mapping[str, Any],
    source: Any,
    cut_rows: bool,
    rows: Mapping[tuple[str, str], bool] | None = None,
) -> dict[int, dict[str, bool]]:
    """Load a torch-layout optimizer state (ids: positions or names) into the sharded optimizer;
    return ``{id(shard): {key: row-shaped in the checkpoint}}`` ([Note: full-shaped optimizer state]),
    what the placement of whole parameters reads instead of guessing by shape.

    ``cut_rows``: the full-shaped tensors are whole and each rank takes its rows (a full file);
    otherwise they are this rank's shards already (a sharded folder), ``rows`` saying which were
    full-shaped in it (``(parameter name, key) -> bool``).
    """
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointError(f"{source}: optimizer state without 'state' and 'param_groups' keys")
    saved_groups = state_dict["param_groups"]
    mapping = resolve_ids(optimizer, owners, saved_groups, source)
    unknown = sorted(map(str, set(state_dict["state"]) - set(mapping)))
    if unknown:
        raise CheckpointError(f"{source}: optimizer state for ids no param group lists: {unknown}")
    held = optimizer_params(optimizer, owners)
    position = {id(p): index for index, p in enumerate(p for params in held for p in params)}
    state, found = {}, {}
    for saved_id, entries in state_dict["state"].items():
        param = mapping[saved_id]
        if cut_rows:
            full = {k: torch.is_tensor(v) and is_full_shaped(param, k, v.shape) for k, v in entries.items()}
        else:
            full = {k: bool((rows or {}).get((param.fqn, k))) for k in entries}
        state[position[id(param)]] = {
            key: param.shard_of_full(value) if cut_rows and full[key] else value for key, value in entries.items()
        }
        found[id(param.sharded)] = full
    groups = [
        {**{k: v for k, v in saved.items() if k != "params"}, "params": [position[id(p)] for p in params]}
        for saved, params in zip(saved_groups, held)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    return found
