"""Optimizer state keyed by parameter name: what full and sharded checkpoints share.

Torch optimizers key their state by position; a checkpoint keys it by the parameter's name
(``ShardedParam.fqn``), so it does not depend on the order parameters were given in, and a
plain (unsharded) optimizer built the same way loads it as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fsdp_strategy.checkpoint.layout import CheckpointError
from fsdp_strategy.engine import get_scheduler
from fsdp_strategy.engine.param import ShardedParam


def shard_owners(module: nn.Module) -> dict[int, ShardedParam]:
    """``id(sharded parameter) -> ShardedParam`` for every parameter of a sharded module."""
    return {id(p.sharded): p for p in get_scheduler(module).sharded_params()}


def named_groups(optimizer: torch.optim.Optimizer, owners: Mapping[int, ShardedParam]) -> list[dict[str, Any]]:
    """The optimizer's param groups with parameter names in place of the parameters."""
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [owners[id(p)].fqn for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def check_names(
    optimizer: torch.optim.Optimizer, owners: Mapping[int, ShardedParam], names: Iterable[str], source: Any
) -> None:
    """Raise if the saved state names parameters this optimizer does not hold."""
    held = {owners[id(p)].fqn for group in optimizer.param_groups for p in group["params"]}
    unknown = sorted(set(names) - held)
    if unknown:
        raise CheckpointError(f"{source}: optimizer state for parameters the optimizer does not hold: {unknown}")


def load_named_state(
    optimizer: torch.optim.Optimizer,
    owners: Mapping[int, ShardedParam],
    state: Mapping[str, dict[str, Any]],
    saved_groups: list[dict[str, Any]],
    source: Any,
) -> None:
    """Load name-keyed per-parameter ``state`` (already this rank's shards) and saved group settings."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{source}: optimizer state has {len(saved_groups)} param groups, the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    check_names(optimizer, owners, state, source)
    index_of: dict[str, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index_of[owners[id(p)].fqn] = len(index_of)
    groups = [
        {
            **{k: v for k, v in saved.items() if k != "params"},
            "params": [index_of[owners[id(p)].fqn] for p in group["params"]],
        }
        for saved, group in zip(saved_groups, optimizer.param_groups)
    ]
    optimizer.load_state_dict(
        {"state": {index_of[fqn]: entries for fqn, entries in state.items()}, "param_groups": groups}
    )
