"""Optimizer steps on a sharded model: steps taken while units are gathered ([Note: edits while
gathered] in edits.py), which optimizers may step shards ([Note: trust by allow-list] in
optimizer_kinds.py) and whole-matrix ones placed whole ([Note: whole-matrix placement] in
whole_matrix.py).

Lightning's manual optimization steps inside ``training_step``, which runs inside the root's
forward, so the root (and any unit kept gathered) is gathered while its shards change. The
engine sees every ``torch.optim.Optimizer`` step of the process through torch's global step
hooks, installed by ``open`` and removed by ``close``: before a step on the shards of a gathered
unit, changes to its full parameters are written back; after it, the unit is gathered again.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fsdp_strategy.engine.device import DeviceLayer
from fsdp_strategy.engine.group_agreement import GroupAgreement
from fsdp_strategy.engine.optimizer_kinds import OptimizerKinds
from fsdp_strategy.engine.trace import traced
from fsdp_strategy.engine.unit import FSDPUnit, ShardedState
from fsdp_strategy.engine.whole_matrix import WholeMatrixSteps
from fsdp_strategy.options import UpdateKind


class OptimizerSteps:
    """Watches optimizer steps for one model's units.

    Costs: a Python call per optimizer step; when a unit is gathered at a step, a scan of the
    optimizer's parameters, a write-back of the unit and one all-gather of it.
    """

    def __init__(
        self,
        units: list[FSDPUnit],
        device_layer: DeviceLayer,
        kinds: OptimizerKinds | None = None,
        whole_matrix: WholeMatrixSteps | None = None,
        agreement: GroupAgreement | None = None,
    ) -> None:
        self._units = units
        self._device_layer = device_layer
        self._kinds = kinds or OptimizerKinds({})
        self._whole_matrix = whole_matrix  # None: a shard group of one (every parameter is whole)
        self._agreement = agreement  # None: a shard group of one ([Note: param groups agree])
        self._held = {id(p.sharded) for unit in units for p in unit.params}
        # id -> name of the parameters split over tensor parallel: only elementwise optimizers step their blocks
        self._split = {id(p.sharded): p.fqn for unit in units for p in unit.params if p.tp is not None and p.tp.sharded}
        # ... and of those, the ones split across their rows: a measurement on row shards cannot vouch for them
        self._across_rows = {
            id(p.sharded) for unit in units for p in unit.params if p.tp is not None and p.tp.splits_rows
        }
        # id -> (weak reference, name) of the parameters sharding replaced: stepping one is a mistake
        self._replaced = {
            id(p.replaced()): (p.replaced, p.fqn) for unit in units for p in unit.params if p.replaced() is not None
        }
        self._checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its groups then
        self._stepping: dict[int, list[FSDPUnit]] = {}  # optimizer id -> gathered units its step changes
        self._checked_groups: set[int] = set()  # ids of this model's optimizers stepping now, not torch's own
        self._active: set[int] = set()  # ids of this model's optimizers stepping now
        self._backward_since_step = False  # a backward finished, and no optimizer of this model stepped since
        self._handles: list[Any] = []
        self.open()

    @classmethod
    def of(
        cls,
        units: list[FSDPUnit],
        device_layer: DeviceLayer,
        comm: Any,
        device: Any,
        optimizer_updates: Mapping[type, UpdateKind] | None,
    ) -> OptimizerSteps:
        """The steps of ``units``' parameters: with a shard group of two or more, whole-matrix placement
        and the param groups' agreement over it; the kinds declared by ``optimizer_updates``."""
        shard_comm, params = units[0].shard_comm, [p for unit in units for p in unit.params]
        sharded = shard_comm.size > 1
        whole = WholeMatrixSteps(params, shard_comm, comm, device) if sharded else None
        agreement = GroupAgreement(shard_comm, comm, device) if sharded else None
        kinds = OptimizerKinds(optimizer_updates or {}, shard_comm, comm, params, device)
        return cls(units, device_layer, kinds, whole, agreement)

    def backward_finished(self) -> None:
        """A backward of this model finished: its gradients wait for an optimizer step."""
        self._backward_since_step = True

    def unapplied_gradients(self) -> bool:
        """Whether this model holds gradients of a backward that no optimizer step has applied yet (an
        accumulation under way): what a checkpoint saved now does not hold. Gradients set to None
        (``zero_grad``) count as none. Costs: a look at each parameter's ``grad`` when a backward
        finished since the last step."""
        return self._backward_since_step and any(
            p.sharded.grad is not None for unit in self._units for p in unit.params
        )

    @property
    def whole_matrix(self) -> WholeMatrixSteps | None:
        """The placement of whole-parameter optimizers (None for a shard group of one)."""
        return self._whole_matrix

    def open(self) -> None:
        """Install the process-wide step hooks (idempotent); they hold this object weakly."""
        if self._handles:
            return
        before, after = weakref.WeakMethod(self._before_step), weakref.WeakMethod(self._after_step)

        def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> Any:
            method = before()
            return method(optimizer, args, kwargs) if method is not None else None

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

    def raise_due(self) -> None:
        """Raise for param groups that differed between the ranks after the last steps, waiting for
        the device ([Note: param groups agree]; outside a step only)."""
        if self._agreement is not None:
            self._agreement.raise_due(everything=True)

    def _gathered_units_of(self, optimizer: Any) -> list[FSDPUnit]:
        gathered = [unit for unit in self._units if unit.state is ShardedState.UNSHARDED]
        if not gathered:
            return []
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [unit for unit in gathered if any(id(p.sharded) in stepped for p in unit.params)]

    @traced("before_optimizer_step")
    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self._concerns(params):
            return None  # another model's optimizer (or a reference's, or the probe's: optimizer_probe.py)
        self._active.add(id(optimizer))  # its post-step hook applies (its groups may hold stand-ins by then)
        # a refused one raises here, before anything changes; with a shard group of one every parameter is whole
        split = [self._split[id(p)] for p in params if id(p) in self._split]
        across = [self._split[id(p)] for p in params if id(p) in self._across_rows]
        known = self._kinds.known(optimizer) if self._whole_matrix is not None or split else UpdateKind.ELEMENTWISE
        unmeasured = self._whole_matrix is None  # a shard group of one: nothing to measure on
        if split and known is not UpdateKind.ELEMENTWISE and (known is not None or unmeasured or across):
            rows = bool(across) and known is None and not unmeasured  # measurable, but not across rows
            raise _refused_on_blocks(optimizer, across if rows else split, known, rows)
        if not self._kinds.torch_own(optimizer):
            self._checked_groups.add(id(optimizer))
        self._refuse_replaced(optimizer)
        self._device_layer.before_host_writes_shards()  # [Note: host and device] 1
        units = self._gathered_units_of(optimizer)
        for unit in units:
            unit.keep_edits(every_param=True)
        if units:
            self._stepping[id(optimizer)] = units
        if known is UpdateKind.ELEMENTWISE or self._whole_matrix is None:
            return None
        return self._with_gradients(optimizer, args, kwargs, split)

    def _with_gradients(self, optimizer: Any, args: tuple, kwargs: dict, split: list[str]) -> tuple[tuple, dict] | None:
        """Once the step's gradients exist (now, or, for a step with a closure (Lightning's), right after
        the closure computed them) and before the update: measure an unknown optimizer ([Note: measure
        what will run]; a refused one raises there) and gather a whole-matrix one's matrices whole."""
        placement = self._whole_matrix
        assert placement is not None
        placement.abandon(optimizer)  # a previous step of it that raised

        def ready() -> None:
            changed = self._kinds.changes(optimizer)
            if self._agreement is not None and changed:
                self._agreement.before_measuring(optimizer)  # only some ranks measuring: an error, not a hang
            elif self._agreement is not None and self._kinds.placed_whole(optimizer):
                self._agreement.before_placing(optimizer)  # meets a rank's before_measuring
            if self._kinds.of(optimizer, changed) is UpdateKind.WHOLE_MATRIX:
                if split:
                    raise _refused_on_blocks(optimizer, split, UpdateKind.WHOLE_MATRIX)
                placement.before_update(optimizer)

        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0]: the optimizer
        if closure is None:
            ready()
            return None

        calls = []

        def placed_closure() -> Any:
            loss = closure()
            if not calls:  # an optimizer may call it again after its update (for the loss): placed once
                calls.append(loss)
                ready()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": placed_closure}
        return (args[0], placed_closure, *args[2:]), kwargs

    def _concerns(self, params: list[Any]) -> bool:
        """Whether an optimizer of ``params`` steps this model: its shards, or parameters sharding replaced."""
        return any(id(p) in self._held or self._was_replaced(p) for p in params)

    def _was_replaced(self, param: Any) -> bool:
        """Whether ``param`` is a parameter sharding replaced (by identity: a new tensor may reuse the
        id of one that is gone)."""
        entry = self._replaced.get(id(param))
        return entry is not None and entry[0]() is param

    def _refuse_replaced(self, optimizer: Any) -> None:
        """An optimizer created before sharding holds the model's old parameters: its steps would
        change tensors the model no longer uses (silently nothing). Costs: a dict lookup per
        parameter, at an optimizer's first step and after it gains a param group."""
        groups = len(optimizer.param_groups)
        if not self._replaced or self._checked.get(optimizer) == groups:
            return
        replaced = self._replaced
        stale = [
            replaced[id(p)][1]
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in replaced and replaced[id(p)][0]() is p
        ]
        if stale:
            raise RuntimeError(
                f"{type(optimizer).__name__} holds {len(stale)} parameters of the model from before it was sharded "
                f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}): the model no longer uses them, so its "
                "steps would change nothing. Create the optimizer after sharding (shard_model, fabric.setup_module), "
                "or set both up together with fabric.setup(model, optimizer)"
            )
        self._checked[optimizer] = groups

    @traced("after_optimizer_step")
    def _after_step(self, optimizer: Any) -> None:
        if id(optimizer) not in self._active:
            return  # another model's optimizer (an FSDP2 one's parameters may hold no storage)
        self._active.discard(id(optimizer))
        self._backward_since_step = False
        if self._whole_matrix is not None:
            self._whole_matrix.after_update(optimizer)
        if id(optimizer) in self._checked_groups:
            self._checked_groups.discard(id(optimizer))
            self._kinds.stepped(optimizer)  # its settings now: a change before its next step is measured
            if self._agreement is not None:
                self._agreement.send(optimizer)  # [Note: param groups agree] in group_agreement.py
        self._device_layer.check_optimizer_step(optimizer)
        units = self._stepping.pop(id(optimizer), [])
        if units:
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for unit in units:
                unit.refresh(stepped)


def _refused_on_blocks(optimizer: Any, split: list[str], kind: UpdateKind | None, across: bool = False) -> TypeError:
    """The error for a non-elementwise optimizer (or one that cannot be measured) holding
    tensor-parallel blocks ([Note: tensor parallel parameters]): it would step a block as a matrix."""
    name = type(optimizer).__name__
    shown = ", ".join(split[:3]) + (f" and {len(split) - 3} more" if len(split) > 3 else "")
    if kind is UpdateKind.WHOLE_MATRIX:
        why = "it reads each parameter whole (a norm, an orthogonalization or a factorization of the matrix)"
    elif across:
        why = (
            "it is not one of torch's elementwise optimizers, and these are split across their rows (a "
            "RowwiseParallel weight's Shard(1)), which its measurement on whole rows cannot vouch for (a statistic "
            "per row would be taken over half a row)"
        )
    else:
        why = "it is not one of torch's elementwise optimizers, and with one data-parallel rank it cannot be measured"
    return TypeError(
        f"{name} cannot step the tensor-parallel parameters {shown}: {why}, and each rank holds only its "
        "tensor-parallel block of them, so it would step a block as if it were the matrix (block-wise Muon at "
        "tensor_parallel_size=2 moved the update by 0.39 relative: DeepSpeed#8437). Step them with an elementwise "
        f"optimizer (AdamW, Adam, SGD, ...), for example in an optimizer of their own; or, if {name} updates each "
        f"element from that element alone, declare it: optimizer_updates={{{name}: 'elementwise'}}"
    )
