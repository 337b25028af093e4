"""How far apart two layouts of the same optimizer are: everything it keeps, not only the parameters
([Note: optimizers measured, not assumed] in optimizer_probe.py).

A snapshot (``optimizer_probe._Run.snapshot``) holds, per measured tensor, its pieces (one whole
tensor, or a row block per rank) with their state, and per optimizer instance its param group's
values and its own attributes. Row-shaped state is joined from the blocks; any other value must be
equal in every instance. Values are compared in float64 within ``RTOL``, relative to each element
(an element below ``FLOOR`` times its tensor's largest relative to that; a tensor of tiny values, a
statistic that has barely started to move, is compared at its own scale),
recursively through lists, tuples, dicts and plain objects (a preconditioner object's fields);
parameters and functions held in state are not compared.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

RTOL = 1e-8
FLOOR = 1e-6  # an element far smaller than its tensor's largest is compared at this fraction of the largest
_DEPTH = 4  # how deep into plain objects held in state a comparison goes


class Difference(NamedTuple):
    """The first place two layouts differ: by how much (relative; ``inf``: structurally) and where."""

    value: float
    where: str
    step: int

    @staticmethod
    def none() -> Difference:
        return Difference(0.0, "", -1)

    @property
    def equal(self) -> bool:
        return self.value <= RTOL

    def describe(self) -> str:
        by = "its structure" if math.isinf(self.value) else f"{self.value:.2g} relative"
        return f"{self.where} (by {by} at step {self.step + 1})"


def snapshot_difference(whole: dict[str, Any], other: dict[str, Any], step: int) -> Difference:
    """The largest difference between two snapshots of the same step, with where it is (the first
    place in the order parameters, state, param group, attributes that differs most)."""
    found: list[tuple[float, str]] = []
    for expected, got in zip(whole["tensors"], other["tensors"]):
        shape, (param,), (state,) = expected
        _, params, states = got
        found.append((_difference(param.detach(), _joined([p.detach() for p in params], shape)), "its parameters"))
        for key in sorted(set(state) | {k for s in states for k in s}, key=str):
            if key not in state or any(key not in s for s in states):
                found.append((math.inf, f"its state keys ({key!r} in one layout only)"))
                continue
            found.append((_state_difference(state[key], [s[key] for s in states], params, shape), f"its state {key!r}"))
    for kind, label in (("groups", "its param group's"), ("attributes", "its attribute")):
        reference = whole[kind][0]
        for values in other[kind]:
            for key in sorted(set(reference) | set(values), key=str):
                if key not in reference or key not in values:
                    found.append((math.inf, f"{label} {key!r} (in one layout only)"))
                else:
                    found.append((_difference(reference[key], values[key]), f"{label} {key!r}"))
    value, where = max(found, key=lambda item: item[0], default=(0.0, ""))
    return Difference(value, where, step) if value > RTOL else Difference.none()


def values_differ(a: Any, b: Any) -> bool:
    """Whether two kept values differ beyond ``RTOL`` (or in structure)."""
    return _difference(a, b) > RTOL


def _joined(pieces: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """One tensor of ``shape`` from its pieces (itself, or zero-padded row blocks)."""
    if len(pieces) == 1 and pieces[0].shape == shape:
        return pieces[0]
    rows = shape[0] if len(shape) else 1
    return torch.cat([p.reshape(-1, *shape[1:]) if len(shape) else p.reshape(-1) for p in pieces])[:rows].reshape(shape)


def _state_difference(expected: Any, values: list[Any], params: list[torch.Tensor], shape: torch.Size) -> float:
    """A state entry of the whole tensor against its pieces': joined when each piece's is shaped like
    that piece (row-shaped state), else each piece's against the whole's."""
    row_shaped = torch.is_tensor(expected) and expected.shape == shape
    if row_shaped and all(torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, params)):
        return _difference(expected, _joined(list(values), shape))
    return max((_difference(expected, value) for value in values), default=0.0)


def _difference(a: Any, b: Any, depth: int = 0) -> float:
    """How far ``b`` is from ``a``: 0 equal, relative otherwise, ``inf`` for another structure."""
    if isinstance(a, torch.nn.Parameter) or isinstance(b, torch.nn.Parameter) or callable(a) and callable(b):
        return 0.0
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape:
            return _scalar_difference(a, b)
        return _tensor_difference(a.detach(), b.detach())
    if isinstance(a, (bool, int, float)) and isinstance(b, (bool, int, float)):
        return _tensor_difference(torch.tensor(float(a)), torch.tensor(float(b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return math.inf
        return max((_difference(x, y, depth) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return math.inf
        return max((_difference(a[k], b[k], depth) for k in a), default=0.0)
    if type(a) is not type(b):
        return math.inf
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return _difference(vars(a), vars(b), depth + 1) if depth < _DEPTH else 0.0
    try:
        return 0.0 if a == b else math.inf
    except Exception:  # noqa: BLE001 - values that cannot be compared are not measured
        return 0.0


def _scalar_difference(a: Any, b: Any) -> float:
    """A one-element tensor against a number (a step count kept as either)."""
    try:
        return _tensor_difference(torch.as_tensor(a).reshape(()).double(), torch.as_tensor(b).reshape(()).double())
    except (RuntimeError, TypeError, ValueError):
        return math.inf


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if a.is_complex() or b.is_complex():
        a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    a, b = a.double(), b.double()
    both_nan = a.isnan() & b.isnan()
    gap = (a - b).abs().masked_fill(both_nan, 0.0)
    gap = gap.masked_fill((a == b) & a.isinf(), 0.0)
    scale = torch.maximum(a.abs().nan_to_num(0.0, 0.0, 0.0).max(), b.abs().nan_to_num(0.0, 0.0, 0.0).max())
    relative = (gap / (a.abs() + FLOOR * scale + 1e-300)).masked_fill(both_nan, 0.0)  # NaN in both: equal
    return relative.nan_to_num(nan=math.inf).max().item()
