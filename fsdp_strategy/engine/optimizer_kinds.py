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
   a gradient, gathered whole with its first gradient (one all-gather of its rows and one of its
   gradient's, over the shard group), measured by one rank (the largest first, to the rank with the
   fewest elements so far) at the shard group's size and padding.
The ranks then agree on everything found (one object gather). The strictest result holds: refused
over placed whole over elementwise; a step that raised on the small tensors is refused only if it
raises on the model's parameters too. A param group that gains a shape later (a parameter unfrozen)
is measured again at the step it first has a gradient. Costs, at that step only: per rank, float64
CPU copies of the parameters it measures (one of each shape; the largest ~ 8 bytes x its elements x
(2 + the optimizer's state per element) x 2 layouts) and the optimizer's own steps on them, three
layouts for up to the steps the hyperparameters announce within ``MODEL_BUDGET`` element-steps
(optimizer_probe.py); beyond that budget the later steps are measured on the small tensors only,
and that is said once.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.muon_with_adamw import MuonWithAdamW
from fsdp_strategy.engine.optimizer_probe import Measured, measure, model_case, toy_shapes
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
        self._said: set[str] = set()

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

    def of(self, optimizer: torch.optim.Optimizer) -> UpdateKind:
        """The kind of ``optimizer``, measured if need be: call it where its gradients exist, before it
        changes a weight ([Note: measure what will run]). A refused one raises ``TypeError``."""
        kind = self.known(optimizer)
        if kind is not None:
            return kind
        shapes = self._shapes(optimizer)
        measured = self._kinds.setdefault(optimizer, {})
        if shapes not in measured:  # once per set of shapes with gradients: a branch that skips some alternates
            measured[shapes] = self._measure(optimizer)
        return measured[shapes]

    def _shapes(self, optimizer: torch.optim.Optimizer) -> tuple:
        """Per param group, the shapes of its sharded parameters that have a gradient."""
        return tuple(
            tuple(sorted({tuple(self._by_id[id(p)].shape) for p in group["params"] if self._stepped(p)}))
            for group in optimizer.param_groups
        )

    def _stepped(self, param: Any) -> bool:
        return id(param) in self._by_id and param.grad is not None

    def _measure(self, optimizer: torch.optim.Optimizer) -> UpdateKind:
        cls = type(optimizer)
        toys = [self._on_small_tensors(optimizer, group) for group in optimizer.param_groups]
        certain = any(m.kind is None and m.ran for m in toys)  # refused whatever the model's parameters show
        models = [None] * len(toys) if certain else self._measure_model(optimizer)
        everyone = self._agreed(cls, toys, models)
        found = [
            _strictest(toy, [ours[index] for _, ours in everyone if ours[index] is not None])
            for index, toy in enumerate(toys)
        ]
        for measured in found:
            log.info("fsdp_custom: measured %s: %s", cls.__qualname__, measured.reason)
            if measured.note and measured.note not in self._said and self._comm is not None and self._comm.rank == 0:
                self._said.add(measured.note)
                log.warning(
                    "fsdp_custom: %s was %s. If you know how it behaves there, %s",
                    cls.__qualname__,
                    measured.note,
                    _DECLARE.format(name=cls.__name__),
                )
        refused = next((m for m in found if m.kind is None), None)
        if refused is not None:
            raise TypeError(
                f"fsdp_custom cannot step {cls.__module__}.{cls.__qualname__} on sharded parameters: measured before "
                f"its first step, {refused.reason}. " + _WHAT_WORKS.format(name=cls.__name__)
            )
        if any(m.kind is UpdateKind.WHOLE_MATRIX for m in found):
            return UpdateKind.WHOLE_MATRIX
        return UpdateKind.ELEMENTWISE

    def _on_small_tensors(self, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> Measured:
        """The measurement on small tensors, once per class, hyperparameters and kinds of tensors."""
        settings = {k: v for k, v in vars(optimizer).items() if k not in ("param_groups", "state") and not callable(v)}
        hyper = {k: v for k, v in group.items() if k != "params"}
        key = (type(optimizer), _frozen(hyper), _frozen(settings), toy_shapes(group))
        if key not in self._measured:
            self._measured[key] = measure(optimizer, group)
        return self._measured[key]

    def _measure_model(self, optimizer: torch.optim.Optimizer) -> list[Measured | None]:
        """Per param group, this rank's measurement of its share of the model's own parameters (None:
        it measures none of that group's) ([Note: measure what will run])."""
        sample = [
            (index, param)
            for index, group in enumerate(optimizer.param_groups)
            for param in _one_of_each_shape([self._by_id[id(p)] for p in group["params"] if self._stepped(p)])
        ]
        if self._comm is None or not sample:
            return [None] * len(optimizer.param_groups)
        mine = _assigned(sample, self._comm.rank, self._comm.size)
        wholes = {}
        for position, (_, param) in enumerate(sample):
            whole = self._gathered(param, param.sharded.detach()), self._gathered(param, param.sharded.grad)
            if position in mine:
                wholes[position] = whole
        found: list[Measured | None] = []
        for index, group in enumerate(optimizer.param_groups):
            positions = [p for p in sorted(mine) if sample[p][0] == index]
            if not positions:
                found.append(None)
                continue
            starts, firsts = [wholes[p][0] for p in positions], [wholes[p][1] for p in positions]
            try:
                found.append(measure(optimizer, group, model_case(optimizer, group, starts, firsts, self._comm.size)))
            except Exception as error:  # noqa: BLE001 - every rank must reach the agreement below, and refuse
                found.append(Measured(None, f"measuring it on the model's parameters raised {error!r}"))
        return found

    def _gathered(self, param: ShardedParam, rows: torch.Tensor) -> torch.Tensor:
        """``param``'s whole tensor from every rank's ``rows`` of it, in float64 on the CPU."""
        assert self._comm is not None and self._ctx is not None
        every = collectives.all_gather_rows(
            rows.to(self._device), self._comm.group, self._ctx.watchdog, what="optimizer_probe"
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
        everyone = collectives.all_gather_objects((toys, models), self._comm.group, self._ctx.watchdog)
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


def _assigned(sample: list[tuple[int, ShardedParam]], rank: int, size: int) -> set[int]:
    """The positions in ``sample`` this rank measures: the largest first, to the rank with the fewest
    elements so far (the same on every rank)."""
    load = [0] * size
    mine = set()
    for position in sorted(range(len(sample)), key=lambda i: (-sample[i][1].shape.numel(), i)):
        owner = min(range(size), key=lambda r: (load[r], r))
        load[owner] += sample[position][1].shape.numel()
        if owner == rank:
            mine.add(position)
    return mine


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
    notes = "; ".join(dict.fromkeys(m.note for m in models if m.note))
    if not toy.ran:
        chosen = chosen._replace(reason=f"{chosen.reason}; on small tensors {toy.reason}, which it never holds")
    return chosen._replace(note=notes)


def _frozen(value: Any) -> Any:
    """A hashable stand-in for a hyperparameter value (tensors by value, containers by content)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if torch.is_tensor(value):  # a hyperparameter by value; a large tensor (the model's) by its kind
        if value.numel() > 64 or value.device.type == "meta":
            return ("tensor", tuple(value.shape), str(value.dtype), id(value))
        return ("tensor", tuple(value.detach().cpu().reshape(-1).tolist()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
