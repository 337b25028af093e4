"""The lines that say where a sharded model lives: ``describe_sharding``, the setup line (the
sharding over the ranks, the units, the parameter counts), and ``PlacementNotice``, the line that
says, once per optimizer, how a whole-matrix optimizer (Muon, Adafactor, ...) places the parameters
it steps ([Note: whole-matrix placement] in engine/whole_matrix.py): known only after its first
step, when the engine has chosen the owners. A part both strategies own, given the model and the
optimizer at each step."""

from __future__ import annotations

import math
import weakref
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from fsdp_strategy.engine import get_scheduler, is_sharded
from fsdp_strategy.engine.diagnosis import count_of, plural


def describe_sharding(model: nn.Module, sharding: str, world_size: int, layout: str, offloaded: bool) -> str:
    """The setup line of a sharded ``model``: ``sharding`` (the strategy's name) over ``world_size``
    ranks (``layout``: a 2-D run's, or ""), the units (the first 8 named), the parameters, trainable
    ones, those in this rank's shards (what Lightning's model summary counts), and whether the
    shards are ``offloaded`` to the CPU. Costs: a walk over the parameters."""
    scheduler = get_scheduler(model)
    units, params = scheduler.units, scheduler.sharded_params()
    full_count = sum(math.prod(p.global_shape) for p in params)
    trainable = sum(math.prod(p.global_shape) for p in params if p.sharded.requires_grad)
    local = sum(p.sharded.numel() for p in params)
    names = ", ".join(unit.name for unit in units[:8]) + (", ..." if len(units) > 8 else "")
    return (
        f"fsdp_custom: {sharding} over {plural(world_size, 'rank')}{layout}, {plural(len(units), 'unit')} ({names}); "
        f"{count_of(full_count)} parameters ({count_of(trainable)} trainable), {count_of(local)} in this rank's "
        f"shards (what Lightning's model summary counts)" + ("; shards offloaded to the CPU" if offloaded else "")
    )


class PlacementNotice:
    """Says on rank 0, after an optimizer's first step, how its parameters are placed, if it steps
    them whole. Costs: a dictionary lookup per step."""

    def __init__(self) -> None:
        self._said: weakref.WeakSet = weakref.WeakSet()

    def after_step(self, model: nn.Module | None, optimizer: Any) -> None:
        """One line for ``optimizer`` the first time it has placed ``model``'s parameters whole."""
        if model is None or optimizer in self._said or not is_sharded(model):
            return
        placement = get_scheduler(model).optimizer_steps.whole_matrix
        line = placement.describe(optimizer) if placement is not None else None
        if line is not None:
            self._said.add(optimizer)
            rank_zero_info(f"fsdp_custom: {line}")
