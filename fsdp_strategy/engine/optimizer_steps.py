"""Optimizer steps taken while units are gathered ([Note: edits while gathered] in unit.py).

Lightning's manual optimization steps inside ``training_step``, which runs inside the root's
forward, so the root (and any unit kept gathered) is gathered while its shards change. The
engine sees every ``torch.optim.Optimizer`` step of the process through torch's global step
hooks, installed by ``open`` and removed by ``close``: before a step on the shards of a gathered
unit, changes to its full parameters are written back; after it, the unit is gathered again.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fsdp_strategy.engine.unit import FSDPUnit, ShardedState


class OptimizerSteps:
    """Watches optimizer steps for one model's units.

    Costs: a Python call per optimizer step; when a unit is gathered at a step, a scan of the
    optimizer's parameters, a write-back of the unit and one all-gather of it.
    """

    def __init__(self, units: list[FSDPUnit]) -> None:
        self._units = units
        self._stepping: dict[int, list[FSDPUnit]] = {}  # optimizer id -> gathered units its step changes
        self._handles: list[Any] = []
        self.open()

    def open(self) -> None:
        """Install the process-wide step hooks (idempotent); they hold this object weakly."""
        if self._handles:
            return
        before, after = weakref.WeakMethod(self._before_step), weakref.WeakMethod(self._after_step)

        def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            method = before()
            if method is not None:
                method(optimizer)

        def post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            method = after()
            if method is not None:
                method(optimizer)

        self._handles = [register_optimizer_step_pre_hook(pre_hook), register_optimizer_step_post_hook(post_hook)]

    def close(self) -> None:
        """Remove the hooks ``open`` installed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stepping.clear()

    def _gathered_units_of(self, optimizer: Any) -> list[FSDPUnit]:
        gathered = [unit for unit in self._units if unit.state is ShardedState.UNSHARDED]
        if not gathered:
            return []
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [unit for unit in gathered if any(id(p.sharded) in stepped for p in unit.params)]

    def _before_step(self, optimizer: Any) -> None:
        units = self._gathered_units_of(optimizer)
        for unit in units:
            unit.keep_edits(every_param=True)
        if units:
            self._stepping[id(optimizer)] = units

    def _after_step(self, optimizer: Any) -> None:
        units = self._stepping.pop(id(optimizer), [])
        if units:
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for unit in units:
                unit.refresh(stepped)
