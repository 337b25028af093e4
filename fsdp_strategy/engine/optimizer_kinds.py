"""Which optimizers step shards as they are, which are placed whole, which are refused.

[Note: trust by allow-list]
Each rank steps only its rows of a parameter. An optimizer whose update of an element depends on
that element alone (SGD, Adam, AdamW, ...: *elementwise*) computes on a shard exactly what it
computes on the whole parameter. One that reads a whole parameter (Muon orthogonalizes each
momentum matrix; Adafactor factorizes each matrix's second moment; LAMB scales by norms) computes
something else on a block of rows, silently. So:
- torch's own optimizers are known: ``ELEMENTWISE`` step shards (``MuonWithAdamW`` too: it steps
  through its inner Muon and AdamW, each classified as itself), ``WHOLE_MATRIX`` (Muon, Adafactor)
  are placed whole ([Note: whole-matrix placement] in whole_matrix.py), LBFGS is refused (it steps
  the whole parameter vector at once: no placement serves it);
- a class the user declares in ``optimizer_updates`` is what the user says;
- any other (a subclass of a known one included: it may change the update) is measured before its
  first step ([Note: optimizers measured, not assumed] in optimizer_probe.py): elementwise, placed
  whole, or refused with a ``TypeError`` saying what was measured and what works instead.
With a shard group of one every parameter is whole on every rank: nothing is classified.

[Note: measure what will run]
A measurement on small tensors cannot see what depends on the model's shapes and gradients (a block
size, "factor a matrix only when a dimension is at least N", a clip that engages only on real
gradients), and an optimizer may refuse tensors it is never given (an optimizer of matrices alone,
given a vector). So an unknown optimizer is measured at its first step, once its gradients exist
(after the closure, for a step that has one) and before it changes a weight, twice:
1. on small tensors shaped like each param group's kinds of parameters, on every rank alike;
2. on the model's own parameters: of each param group, one parameter of each distinct shape that has
   a gradient, then the others while a rank's others stay within ``OTHERS_BUDGET`` elements (for
   ``STEPS`` steps: a branch one parameter of a shape takes, as a max-norm projection), each
   gathered whole with its first gradient (one all-gather of its rows and one of its gradient's,
   over the shard group), measured by one rank (the largest first, to the rank with the fewest
   elements so far) at the shard group's size and padding; parameters left out are said once.
The ranks then agree on everything found (one object gather). The strictest result holds: refused
over placed whole over elementwise; a step that raised on the small tensors is refused only if it
raises on the model's parameters too. A param group that gains a shape later (a parameter unfrozen)
is measured again at the step it first has a gradient, and an optimizer whose param group values or
attributes changed regime since its last step (``_regime``: a float's sign, a flag, a tensor written
in place; not what schedulers write every step, ``SCHEDULED``) is measured again at its next step,
with the new values. An optimizer once placed whole stays placed whole (its owners hold state the
other ranks lack; a per-parameter optimizer is exact placed whole, elementwise or not). Costs, at
that step only: per rank, float64 CPU copies of the parameters it measures (one of each shape and
others up to ``OTHERS_BUDGET`` elements; ~ 8 bytes x elements x (2 + the optimizer's state per
element) x 2 layouts) and the optimizer's own steps on them, three layouts for up to the steps the
hyperparameters announce within ``MODEL_BUDGET`` element-steps (optimizer_probe.py); beyond that
budget the later steps are measured on the small tensors only, and that is said once.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdp_strategy.engine import control
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.muon_with_adamw import MuonWithAdamW
from fsdp_strategy.engine.optimizer_probe import OTHERS_BUDGET, Measured, measure, model_case, toy_shapes
from fsdp_strategy.engine.optimizer_settings import STEPS, frozen, settings_of
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.options import UpdateKind

log = logging.getLogger(__name__)


def _torch_optimizers(*names: str) -> tuple[type, ...]:
    return tuple(getattr(torch.optim, name) for name in names if hasattr(torch.optim, name))


ELEMENTWISE = (
    *_torch_optimizers(
        "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop"
    ),
    MuonWithAdamW,  # updates nothing itself: its inner Muon and AdamW steps are classified as theirs
)
WHOLE_MATRIX = _torch_optimizers("Muon", "Adafactor")
REFUSED = dict.fromkeys(
    _torch_optimizers("LBFGS"),
    "it steps the whole parameter vector at once (line search, curvature pairs over every parameter), which "
    "no rank holds",
)
_DECLARE = (
    "declare it: optimizer_updates={{{name}: 'elementwise'}} (shards step as they are) or 'whole_matrix' "
    "(each parameter stepped whole on one rank)"
)
_WHAT_WORKS = (
    "sharding_strategy='NO_SHARD' (every rank steps whole parameters, as DDP) works with it; or, if you know "
    "better, " + _DECLARE
)


class OptimizerKinds:
    """The kind of each optimizer stepping a model's shards ([Note: trust by allow-list]).

    Costs: a dict lookup per step (for a measured optimizer, also a look at which of its parameters
    have a gradient); an unknown optimizer's first step measures it ([Note: measure what will run])."""

    def __init__(
        self,
        declared: Mapping[type, UpdateKind],
        comm: CommGroup | None = None,
        ctx: CommContext | None = None,
        params: Sequence[ShardedParam] = (),
        device: torch.device | None = None,
    ) -> None:
        self.declared = dict(declared)
        self._comm, self._ctx = comm, ctx
        self._by_id = {id(p.sharded): p for p in params}
        self._device = device or torch.device("cpu")
        self._measured: dict[Any, Measured] = {}  # (class, hyperparameters, kinds of tensors) -> on small tensors
        self._kinds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> {shapes: kind}
        self._said: set[tuple[type, str]] = set()
        self._after_step: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its settings then
        self._unmeasured = ""  # the last model measurement's parameters left out, if any
        self._placed_whole: weakref.WeakSet = weakref.WeakSet()  # measured optimizers ever placed whole

    def known(self, optimizer: torch.optim.Optimizer) -> UpdateKind | None:
        """The kind of ``optimizer`` if it needs no measurement (declared, torch's own); None if it
        does. A refused one raises ``TypeError`` saying why."""
        cls = type(optimizer)
        if cls in self.declared:
            return self.declared[cls]
        if cls in REFUSED:
            raise TypeError(
                f"{cls.__name__} cannot step sharded parameters: {REFUSED[cls]}; "
                + _WHAT_WORKS.format(name=cls.__name__)
            )
        if cls in WHOLE_MATRIX:
            return UpdateKind.WHOLE_MATRIX
        if cls in ELEMENTWISE:
            return UpdateKind.ELEMENTWISE
        return None

    @staticmethod
    def torch_own(optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is one of torch's own, known to set no param group value from data."""
        return type(optimizer) in ELEMENTWISE or type(optimizer) in WHOLE_MATRIX

    def of(self, optimizer: torch.optim.Optimizer, changed: list[str]) -> UpdateKind:
        """The kind of ``optimizer``, measured if need be: call it where its gradients exist, before it
        changes a weight ([Note: measure what will run]), with ``changes(optimizer)`` (measured again
        where there are any). A refused one raises ``TypeError``."""
        kind = self.known(optimizer)
        if kind is not None:
            return kind
        shapes = self._shapes(optimizer)
        if changed:  # [Note: measure what will run]: measured again at the values it steps with now
            log.info(
                "fsdp_custom: %s's %s changed since its last step: measured again", type(optimizer).__name__, changed
            )
            self._kinds.pop(optimizer, None)
        measured = self._kinds.setdefault(optimizer, {})
        if shapes not in measured:  # once per set of shapes with gradients: a branch that skips some alternates
            when = f"again before it steps with the changed {', '.join(map(repr, changed))}" if changed else ""
            measured[shapes] = self._measure(optimizer, when or "before its first step")
            if measured[shapes] is UpdateKind.WHOLE_MATRIX:
                self._placed_whole.add(optimizer)
        if optimizer in self._placed_whole:  # its owners hold state the others lack: placed whole from then on
            return UpdateKind.WHOLE_MATRIX
        return measured[shapes]

    def changes(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The values that may switch a branch of a measured ``optimizer`` changed since its last step, for
        which ``of`` measures it again (on this rank: [Note: param groups agree] makes sure every rank
        does); none for a known one."""
        return [] if self.known(optimizer) is not None else self._changed_since_step(optimizer)

    def placed_whole(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a measurement ever placed ``optimizer`` whole (the same on every rank)."""
        return optimizer in self._placed_whole

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """After a step of a measured optimizer: its param group values then, to tell at the next step
        which ones were changed in between (by the user or a scheduler) from those its step changes."""
        if self.known(optimizer) is None:
            self._after_step[optimizer] = settings_of(optimizer)

    def _changed_since_step(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The param group values changed since ``optimizer``'s last step, but a scheduler's
        (``SCHEDULED``); every one if a param group was added."""
        before = self._after_step.get(optimizer)
        if before is None:
            return []
        now = settings_of(optimizer)
        if len(now) != len(before):
            return ["param groups"]
        if now[-1] != before[-1]:  # the optimizer's own attributes
            return sorted(
                f"attribute {key!r}"
                for key in set(now[-1]) | set(before[-1])
                if now[-1].get(key) != before[-1].get(key)
            )
        return sorted(
            {
                key
                for old, new in zip(before, now)
                for key in set(old) ^ set(new) | {k for k in set(old) & set(new) if old[k] != new[k]}
            }
        )

    def _shapes(self, optimizer: torch.optim.Optimizer) -> tuple:
        """Per param group, the shapes of its sharded parameters that have a gradient."""
        return tuple(
            tuple(sorted({tuple(self._by_id[id(p)].shape) for p in group["params"] if self._stepped(p)}))
            for group in optimizer.param_groups
        )

    def _stepped(self, param: Any) -> bool:
        return id(param) in self._by_id and param.grad is not None

    def _measure(self, optimizer: torch.optim.Optimizer, when: str) -> UpdateKind:
        cls = type(optimizer)
        toys = [self._on_small_tensors(optimizer, group) for group in optimizer.param_groups]
        certain = any(m.kind is None and m.ran for m in toys)  # refused whatever the model's parameters show
        models = [None] * len(toys) if certain else self._measure_model(optimizer)
        everyone = self._agreed(cls, toys, models)
        found = [
            _strictest(toy, [ours[index] for _, ours in everyone if ours[index] is not None])
            for index, toy in enumerate(toys)
        ]
        notes = [m.note for m in found if m.note] + ([self._unmeasured] if self._unmeasured else [])
        self._unmeasured = ""
        for measured in found:
            log.info("fsdp_custom: measured %s: %s", cls.__qualname__, measured.reason)
        for note in notes:
            if (cls, note) not in self._said and self._comm is not None and self._comm.rank == 0:
                self._said.add((cls, note))
                log.warning(
                    "fsdp_custom: %s was %s. If you know how it behaves there, %s",
                    cls.__qualname__,
                    note,
                    _DECLARE.format(name=cls.__name__),
                )
        refused = next((m for m in found if m.kind is None), None)
        if refused is not None:
            raise TypeError(
                f"fsdp_custom cannot step {cls.__module__}.{cls.__qualname__} on sharded parameters: measured {when}, "
                f"{refused.reason}. " + _WHAT_WORKS.format(name=cls.__name__)
            )
        if any(m.kind is UpdateKind.WHOLE_MATRIX for m in found):
            return UpdateKind.WHOLE_MATRIX
        return UpdateKind.ELEMENTWISE

    def _on_small_tensors(self, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> Measured:
        """The measurement on small tensors, once per class, hyperparameters and kinds of tensors."""
        settings = {k: v for k, v in vars(optimizer).items() if k not in ("param_groups", "state") and not callable(v)}
        hyper = {k: v for k, v in group.items() if k != "params"}
        key = (type(optimizer), frozen(hyper), frozen(settings), toy_shapes(group))
        if key not in self._measured:
            self._measured[key] = measure(optimizer, group)
        return self._measured[key]

    def _measure_model(self, optimizer: torch.optim.Optimizer) -> list[Measured | None]:
        """Per param group, this rank's measurement of its share of the model's own parameters (None:
        it measures none of that group's) ([Note: measure what will run])."""
        representatives, others = [], []
        for index, group in enumerate(optimizer.param_groups):
            params = [self._by_id[id(p)] for p in group["params"] if self._stepped(p)]
            chosen = _one_of_each_shape(params)
            representatives += [(index, param) for param in chosen]
            others += [(index, param) for param in params if param not in chosen]
        sample = representatives + others
        if self._comm is None or not sample:
            return [None] * len(optimizer.param_groups)
        owners = _owners(sample, len(representatives), self._comm.size)
        mine = {position for position, owner in owners.items() if owner == self._comm.rank}
        if len(owners) < len(sample):
            self._unmeasured = (
                f"measured on {len(owners)} of the model's {len(sample)} parameters with a gradient (one of each "
                f"shape, then the others within {OTHERS_BUDGET:.3g} elements per rank): a branch that only the "
                "others take was not"
            )
        wholes = {}
        for position, (_, param) in enumerate(sample):
            if position not in owners:
                continue
            whole = self._gathered(param, param.sharded.detach()), self._gathered(param, param.sharded.grad)
            if position in mine:
                wholes[position] = whole
        found: list[Measured | None] = []
        for index, group in enumerate(optimizer.param_groups):
            results = []
            for part in (range(len(representatives)), range(len(representatives), len(sample))):
                positions = [p for p in sorted(mine) if p in part and sample[p][0] == index]
                if positions:
                    results.append(self._measure_on(optimizer, group, [wholes[p] for p in positions], part.start > 0))
            found.append(_stricter(results) if results else None)
        return found

    def _measure_on(
        self, optimizer: torch.optim.Optimizer, group: dict[str, Any], wholes: list[tuple], others: bool
    ) -> Measured:
        """One measurement on whole parameters with their first gradients: the representatives of each
        shape for the steps the hyperparameters announce (within the budget), the others for ``STEPS``."""
        assert self._comm is not None
        starts, firsts = [whole[0] for whole in wholes], [whole[1] for whole in wholes]
        try:
            case = model_case(optimizer, group, starts, firsts, self._comm.size)
            if others:
                case = case._replace(steps=min(case.steps, STEPS), note="")
            return measure(optimizer, group, case)
        except Exception as error:  # noqa: BLE001 - every rank must reach the agreement, and refuse
            return Measured(None, f"measuring it on the model's parameters raised {error!r}")

    def _gathered(self, param: ShardedParam, rows: torch.Tensor) -> torch.Tensor:
        """``param``'s whole tensor from every rank's ``rows`` of it, in float64 on the CPU."""
        assert self._comm is not None and self._ctx is not None
        every = control.all_gather_rows(
            rows.to(self._device), self._comm.group, control.watchdog_of(self._ctx), what="optimizer_probe"
        )
        whole = param.full_from_rows(every.reshape(self._comm.size, -1))
        return whole.to("cpu", torch.complex128 if whole.is_complex() else torch.float64)

    def _agreed(
        self, cls: type, toys: list[Measured], models: list[Measured | None]
    ) -> list[tuple[list[Measured], list[Measured | None]]]:
        """Every rank's measurements; those on small tensors must be the same on every rank (each rank's
        collectives follow them)."""
        if self._comm is None or self._comm.size == 1 or self._ctx is None:
            return [(toys, models)]
        everyone = control.all_gather_objects((toys, models), self._comm.group, control.watchdog_of(self._ctx))
        kinds = [[m.kind for m in theirs] for theirs, _ in everyone]
        if any(k != kinds[0] for k in kinds):
            raise RuntimeError(
                f"fsdp_custom: the ranks measured {cls.__qualname__} differently ({kinds}): their float64 "
                f"arithmetic differs. Declare it: optimizer_updates={{{cls.__name__}: ...}}"
            )
        return everyone


def _one_of_each_shape(params: list[ShardedParam]) -> list[ShardedParam]:
    seen: dict[tuple, ShardedParam] = {}
    for param in params:
        seen.setdefault((tuple(param.shape), param.sharded.dtype), param)
    return list(seen.values())


def _owners(sample: list[tuple[int, ShardedParam]], representatives: int, size: int) -> dict[int, int]:
    """``position -> rank`` of the parameters of ``sample`` measured (the same on every rank): every
    representative of a shape (the first ``representatives``), the largest first, to the rank with the
    fewest elements so far; then the others the same way while a rank's others stay within
    ``OTHERS_BUDGET`` elements."""
    load, others_load, owners = [0] * size, [0] * size, {}
    for part in (range(representatives), range(representatives, len(sample))):
        for position in sorted(part, key=lambda i: (-sample[i][1].shape.numel(), i)):
            numel = sample[position][1].shape.numel()
            owner = min(range(size), key=lambda r: (load[r], r))
            if part.start > 0:
                if others_load[owner] + numel > OTHERS_BUDGET:
                    continue
                others_load[owner] += numel
            load[owner] += numel
            owners[position] = owner
    return owners


def _stricter(found: list[Measured]) -> Measured:
    """One rank's measurements of a param group's parameters together: a refusal (or a step that
    raised) over placed whole over elementwise."""
    refused = next((m for m in found if m.kind is None), None)
    if refused is not None:
        return refused
    chosen = next((m for m in found if m.kind is UpdateKind.WHOLE_MATRIX), found[0])
    return chosen._replace(note="; ".join(dict.fromkeys(m.note for m in found if m.note)))


def _strictest(toy: Measured, models: list[Measured]) -> Measured:
    """What a param group's measurements say together: a refusal over placed whole over elementwise;
    a step that raised on small tensors counts only if it raised on the model's parameters too."""
    ran = [m for m in (toy, *models) if m.ran]
    refused = next((m for m in ran if m.kind is None), None)
    if refused is not None:
        return refused
    raised = next((m for m in models if not m.ran), None)
    if raised is not None:
        return Measured(None, f"{raised.reason}: it cannot step the model's own parameters", note=raised.note)
    if not ran:
        return toy
    chosen = next((m for m in ran if m.kind is UpdateKind.WHOLE_MATRIX), ran[0])
    notes = "; ".join(dict.fromkeys(m.note for m in (toy, *models) if m.note))
    if not toy.ran:
        chosen = chosen._replace(reason=f"{chosen.reason}; on small tensors {toy.reason}, which it never holds")
    return chosen._replace(note=notes)
