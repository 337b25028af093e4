"""Which optimizers step shards as they are, which are placed whole, which are refused.

[Note: trust by allow-list]
Each rank steps only its rows of a parameter. An optimizer whose update of an element depends on
that element alone (SGD, Adam, AdamW, ...: *elementwise*) computes on a shard exactly what it
computes on the whole parameter. One that reads the whole matrix (Muon orthogonalizes each
momentum matrix; Adafactor factorizes each matrix's second moment into row and column statistics)
computes something else on a block of rows, silently. So the engine trusts only what it knows:
- elementwise: torch's optimizers listed in ``ELEMENTWISE``, exactly these classes, step shards
  (``MuonWithAdamW`` too: it steps through its inner Muon and AdamW, each classified as itself);
- whole-matrix: ``WHOLE_MATRIX`` (torch's Muon) and what the user declares so are placed whole
  ([Note: whole-matrix placement] in whole_matrix.py);
- refused: LBFGS (it steps the whole parameter vector at once: no placement serves it), Adafactor
  unless declared whole-matrix;
- anything else (a subclass included: it may change the update): one warning naming it, saying
  why, and naming ``optimizer_updates``, the argument by which the user declares it; it then steps
  shards as if elementwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from fsdp_strategy.engine.muon_with_adamw import MuonWithAdamW
from fsdp_strategy.options import UpdateKind


def _torch_optimizers(*names: str) -> tuple[type, ...]:
    return tuple(getattr(torch.optim, name) for name in names if hasattr(torch.optim, name))


ELEMENTWISE = (
    *_torch_optimizers(
        "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop"
    ),
    MuonWithAdamW,  # updates nothing itself: its inner Muon and AdamW steps are classified as theirs
)
WHOLE_MATRIX = _torch_optimizers("Muon")
REFUSED = {
    **dict.fromkeys(
        _torch_optimizers("LBFGS"),
        "it steps the whole parameter vector at once (line search, curvature pairs over every parameter), which "
        "no rank holds; use an elementwise optimizer (SGD, Adam, AdamW, ...)",
    ),
    **dict.fromkeys(
        _torch_optimizers("Adafactor"),
        "it factorizes each matrix's second moment into row and column statistics, so on a shard of rows it "
        "computes something else; declare it placed whole: optimizer_updates={torch.optim.Adafactor: "
        "'whole_matrix'}",
    ),
}


class OptimizerKinds:
    """The kind of each optimizer stepping a model's shards ([Note: trust by allow-list]); warns once
    per unknown class. Costs: a dict lookup per step."""

    def __init__(self, declared: Mapping[type, UpdateKind]) -> None:
        self.declared = dict(declared)
        self._warned: set[type] = set()

    def of(self, optimizer: torch.optim.Optimizer) -> UpdateKind:
        """The kind of ``optimizer``; a refused one raises ``TypeError`` saying why."""
        cls = type(optimizer)
        if cls in self.declared:
            return self.declared[cls]
        if cls in REFUSED:
            raise TypeError(f"{cls.__name__} cannot step sharded parameters: {REFUSED[cls]}")
        if cls in WHOLE_MATRIX:
            return UpdateKind.WHOLE_MATRIX
        if cls in ELEMENTWISE:
            return UpdateKind.ELEMENTWISE
        if cls not in self._warned:
            self._warned.add(cls)
            warnings.warn(
                f"fsdp_custom does not know the optimizer {cls.__module__}.{cls.__qualname__}: each rank steps only "
                "its rows of every parameter, which is exact for an elementwise update (each element's update depends "
                "on that element alone, as SGD's and AdamW's) and wrong, silently, for one that reads whole matrices "
                "(norms, orthogonalization, row and column statistics). It steps the shards as if elementwise; declare "
                f"which it is: optimizer_updates={{{cls.__name__}: 'elementwise'}} or 'whole_matrix' (each matrix "
                "stepped whole on one rank)",
                stacklevel=4,
            )
        return UpdateKind.ELEMENTWISE
