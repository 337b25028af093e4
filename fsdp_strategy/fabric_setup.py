"""What Fabric's ``setup`` asks of the strategy besides sharding: optimizers created before the model
was sharded pointed at its shards, and ``fabric.no_backward_sync`` as the engine's ``no_sync``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from torch.optim import Optimizer

from fsdp_strategy.engine import get_scheduler, is_sharded


def sharded_with_optimizers(
    module: nn.Module, optimizers: list[Optimizer], shard: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """``shard(module)``, then each of ``optimizers`` (created before, with no state yet) pointed at the
    shards that replaced its parameters. Costs: a walk over the parameters."""
    for optimizer in optimizers:
        if optimizer.state:
            raise ValueError(
                f"{type(optimizer).__name__} already holds state for the unsharded parameters; set the model up "
                "first (fabric.setup_module), then create the optimizer and call fabric.setup_optimizers"
            )
    owners = {
        id(p): (owner, name) for owner in module.modules() for name, p in owner._parameters.items() if p is not None
    }
    module = shard(module)
    for optimizer in optimizers:
        _point_at_shards(optimizer, owners)
    return module


class NoBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the engine's ``no_sync`` (full gradients kept until a backward outside)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """Keep full gradients of ``module`` (set up by the strategy) for the next backward, if ``enabled``."""
        if not enabled:
            return nullcontext()
        if not is_sharded(module):
            raise TypeError(
                f"no_backward_sync needs the module that fabric.setup returned, got {type(module).__name__}"
            )
        return get_scheduler(module).no_sync()


def _point_at_shards(optimizer: Optimizer, owners: dict[int, tuple[nn.Module, str]]) -> None:
    """Replace each parameter of ``optimizer`` that ``owners`` knows by what its module holds now
    (its shard); a parameter used twice (tied) is listed once."""
    for group in optimizer.param_groups:
        replaced: dict[int, torch.Tensor] = {}
        for param in group["params"]:
            owner = owners.get(id(param))
            now = owner[0]._parameters[owner[1]] if owner is not None else param
            replaced.setdefault(id(now), now)
        group["params"] = list(replaced.values())
