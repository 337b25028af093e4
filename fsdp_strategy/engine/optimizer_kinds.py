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
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.muon_with_adamw import MuonWithAdamW
from fsdp_strategy.engine.optimizer_probe import Measured, measure
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
_WHAT_WORKS = (
    "sharding_strategy='NO_SHARD' (every rank steps whole parameters, as DDP) works with it; or, if you know "
    "better, declare it: optimizer_updates={{{name}: 'elementwise'}} (shards step as they are) or 'whole_matrix' "
    "(each parameter stepped whole on one rank)"
)


class OptimizerKinds:
    """The kind of each optimizer stepping a model's shards ([Note: trust by allow-list]).

    Costs: a dict lookup per step; an unknown optimizer's first step measures it (milliseconds,
    once per class and hyperparameters) and the ranks agree on the result (one object gather)."""

    def __init__(
        self, declared: Mapping[type, UpdateKind], comm: CommGroup | None = None, ctx: CommContext | None = None
    ) -> None:
        self.declared = dict(declared)
        self._comm, self._ctx = comm, ctx
        self._measured: dict[Any, Measured] = {}  # (class, hyperparameters) -> what the probe found
        self._kinds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (groups, kind)

    def of(self, optimizer: torch.optim.Optimizer) -> UpdateKind:
        """The kind of ``optimizer``; a refused one raises ``TypeError`` saying why."""
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
        known = self._kinds.get(optimizer)
        if known is not None and known[0] == len(optimizer.param_groups):
            return known[1]
        kind = self._measure(optimizer)
        self._kinds[optimizer] = (len(optimizer.param_groups), kind)
        return kind

    def _measure(self, optimizer: torch.optim.Optimizer) -> UpdateKind:
        cls = type(optimizer)
        found = []
        for group in optimizer.param_groups:
            key = (cls, _frozen({k: v for k, v in group.items() if k != "params"}))
            if key not in self._measured:
                self._measured[key] = self._agreed(cls, measure(optimizer, group))
                measured = self._measured[key]
                log.info("fsdp_custom: measured %s: %s", cls.__qualname__, measured.reason)
            found.append(self._measured[key])
        refused = next((m for m in found if m.kind is None), None)
        if refused is not None:
            raise TypeError(
                f"fsdp_custom cannot step {cls.__module__}.{cls.__qualname__} on sharded parameters: measured before "
                f"its first step, {refused.reason}. " + _WHAT_WORKS.format(name=cls.__name__)
            )
        if any(m.kind is UpdateKind.WHOLE_MATRIX for m in found):
            return UpdateKind.WHOLE_MATRIX
        return UpdateKind.ELEMENTWISE

    def _agreed(self, cls: type, measured: Measured) -> Measured:
        """Every rank's measurement, which must be the same (each rank's collectives follow it)."""
        if self._comm is None or self._comm.size == 1 or self._ctx is None:
            return measured
        kinds = collectives.all_gather_objects(measured.kind, self._comm.group, self._ctx.watchdog)
        if any(kind != kinds[0] for kind in kinds):
            raise RuntimeError(
                f"fsdp_custom: the ranks measured {cls.__qualname__} differently ({[str(k) for k in kinds]}): their "
                f"float64 arithmetic differs. Declare it: optimizer_updates={{{cls.__name__}: ...}}"
            )
        return measured


def _frozen(value: Any) -> Any:
    """A hashable stand-in for a hyperparameter value (tensors by value, containers by content)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if torch.is_tensor(value):
        return ("tensor", tuple(value.detach().cpu().reshape(-1).tolist()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
