"""PlacementNotice: the line that says, once per optimizer, how a whole-matrix optimizer (Muon,
Adafactor, ...) places the parameters it steps ([Note: whole-matrix placement] in
engine/whole_matrix.py): known only after its first step, when the engine has chosen the owners.
A part both strategies own, given the model and the optimizer at each step."""

from __future__ import annotations

import weakref
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from fsdp_strategy.engine import get_scheduler, is_sharded


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
