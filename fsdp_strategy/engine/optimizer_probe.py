"""Measuring an optimizer the engine does not know, before its first step.

[Note: optimizers measured, not assumed]
Each rank steps only its rows of a parameter. Whether that is exact depends on what the update of
an element reads, which no name or warning can tell. So an optimizer class the engine does not
know is measured, in float64 on the CPU, three layouts stepping from the same start:
- whole: one instance of the optimizer over every measured tensor;
- rows: one instance per rank over that rank's zero-padded row blocks ([Note: shard layout]): what
  stepping shards does;
- per parameter: one instance per tensor: what placing each parameter whole on one rank does.
Rows equal to whole: the update is elementwise, shards step as they are. Otherwise, per parameter
equal to whole: the update of a parameter reads that parameter only, and it is exact placed whole
([Note: whole-matrix placement]). Otherwise the update of one parameter depends on the others
(Prodigy's and D-Adaptation's global ``d``): refused.

"Equal" is everything the optimizer keeps, not only the parameters: its per-parameter state
(row-shaped state joined from the blocks, any other state equal in every instance), its param
groups' values and its own attributes, within ``RTOL`` in float64 (far below float32's rounding: a
measured difference is structural). So a statistic summed over parameters or rows shows at the
first step it accumulates, even while the update does not use it yet (Prodigy's ``d_numerator``
before ``d`` grows); where the layouts first differ is said ("its param group's 'd_numerator'").

Two measurements, both before the optimizer changes a weight ([Note: measure what will run] in
optimizer_kinds.py has when and where):
- on small tensors (``toy_case``): a 7 x 6 matrix, whose rows split unevenly over 2 and 3 ranks,
  and a vector of 6 (only the numbers of dimensions the param group holds), over ``STEPS`` steps or
  past the largest hyperparameter that counts steps (a preconditioner first computed at step 1000 is
  run to step 1002; any other integer of the param group, up to 64, e.g. a history of ``keep_num``
  gradients), with gradients that differ by row, by column and by step (one step's far larger than
  the others', so a clip or a running statistic that is uniform at the first step shows; others
  along the weights or orthogonal to them, so a branch on their cosine shows);
- on the model's own parameters (``model_case``): their values and first gradients, the shard
  group's own size and padding, for as many of those steps as ``MODEL_BUDGET`` allows (the first
  gradient as it is, then gradients drawn around it): shape thresholds (block sizes, "factor only
  when a dimension is at least N") and clipping that engages only on real gradients show there.
A learning rate of 0 (a warmup's first step) is measured as 1e-3. The optimizer is copied without
its state (its attributes kept, so settings outside its param groups are measured too; tensors of
the model it refers to replaced by meta stand-ins, so the probe can never touch them); one that
wraps another optimizer (Lookahead, OrthoGrad) is refused, to be declared. An optimizer the probe
cannot run (it needs a closure, it draws random numbers, it cannot be built from its param group)
is refused naming what stopped it; one whose step raised on tensors it is given is refused only if
it raised on the model's own. The global random state is saved and restored around a measurement.
What it cannot see: a change of behaviour that no step-counting hyperparameter announces and that
comes later than the last step measured, when nothing it keeps moved before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fsdp_strategy.engine.optimizer_copies import ProbeStopped, build, refuse_random_construction, torch_hooks
from fsdp_strategy.engine.optimizer_copies import step as step_once
from fsdp_strategy.engine.optimizer_settings import MAX_STEPS, STEPS, announced_steps, probe_steps
from fsdp_strategy.engine.probe_compare import Difference, snapshot_difference, values_differ
from fsdp_strategy.options import UpdateKind

SHAPES = ((7, 6), (6,))  # a matrix whose rows split unevenly over 2 and 3 ranks, and a vector
RANKS = 3  # the row blocks of the small tensors: shards over 3 ranks, zero-padded as the engine pads them
STEP_SCALES = (1.0, 50.0, 0.02, 1.0)  # a step with far larger gradients: clips and running statistics show
MODEL_BUDGET = 1 << 28  # elements x steps measured on the model's parameters per rank, beyond STEPS
OTHERS_BUDGET = 1 << 22  # elements per rank of the parameters measured beside one of each shape, for STEPS


class Measured(NamedTuple):
    """What a measurement found: a kind, or None (refused) and why."""

    kind: UpdateKind | None
    reason: str  # what was measured, or what stopped the measurement
    ran: bool = True  # False: the optimizer's step raised on the tensors it was given (they may not be its kind)
    note: str = ""  # what this measurement could not reach (said once to the user)


class Case(NamedTuple):
    """Tensors to measure on: whole starting values (float64), the gradients of each step, the ranks
    their rows split over, the steps to run, and where they come from (for the reasons)."""

    starts: list[torch.Tensor]
    gradient: Callable[[int], list[torch.Tensor]]  # step -> a gradient per tensor
    ranks: int
    steps: int
    where: str
    note: str = ""  # what these steps do not reach


def measure(optimizer: torch.optim.Optimizer, group: dict[str, Any], case: Case | None = None) -> Measured:
    """Measure ``optimizer``'s class with ``group``'s hyperparameters on ``case`` (small tensors shaped
    like the group's when None) ([Note: optimizers measured, not assumed]). Never raises for the
    optimizer's own failures: they are the reason it is refused."""
    state = torch.random.get_rng_state()
    case = case or toy_case(optimizer, group)
    group = _moving(group)
    try:
        refuse_random_construction(optimizer, group, case.starts)
        try:
            rows = _compare(optimizer, group, case, _rows)
        except ProbeStopped as stopped:  # a row block it cannot step (a rank's 3 x 11): not elementwise
            if stopped.ran:
                raise
            rows = Difference(math.inf, f"its step on a row block ({stopped})", 0)
        if rows.equal:
            return Measured(
                UpdateKind.ELEMENTWISE,
                f"its update of an element reads that element only ({case.where})",
                note=case.note,
            )
        per_param = _compare(optimizer, group, case, _per_param)
        if per_param.equal:
            _refuse_empty_groups(optimizer, group, case)
            return Measured(
                UpdateKind.WHOLE_MATRIX,
                f"stepping rows of a parameter changes {rows.describe()}, stepping each parameter alone does "
                f"not ({case.where}): it reads whole parameters",
                note=case.note,
            )
        return Measured(
            None,
            "the update of one parameter depends on the others: stepping each parameter with its own instance "
            f"changed {per_param.describe()} ({case.where})",
        )
    except ProbeStopped as stopped:
        return Measured(None, f"{stopped} ({case.where})", ran=stopped.ran)
    finally:
        torch.random.set_rng_state(state)


# ---- what is measured ------------------------------------------------------------------------------


def toy_shapes(group: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """Small shapes with the numbers of dimensions ``group`` holds: ``SHAPES`` for matrices and
    vectors; two of one kind when the group holds only that kind (an optimizer of matrices alone is
    never given a vector)."""
    dims = sorted({max(p.dim(), 1) for p in group["params"]}) or [2, 1]
    if dims == [1, 2]:
        return SHAPES
    shapes = tuple((7, *range(6, 6 - (d - 1), -1)) for d in dims)
    if len(shapes) == 1:
        shapes += ((5, *reversed(shapes[0][1:])),)
    return shapes


def toy_case(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> Case:
    """Small random tensors shaped like ``group``'s kinds of parameters, over ``RANKS`` ranks."""
    shapes = toy_shapes(group)
    generator = torch.Generator().manual_seed(1234)
    starts = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]

    def gradient(step: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(4321 + step)
        grads = []
        for start in starts:
            grad = _varied(start, torch.randn(start.shape, generator=generator, dtype=torch.float64), step)
            rows = torch.logspace(-1, 1, start.shape[0], dtype=torch.float64)
            grad *= rows.view(-1, *([1] * (start.dim() - 1)))
            if start.dim() > 1:
                columns = torch.logspace(0.5, -0.5, start.shape[1], dtype=torch.float64)
                grad *= columns.view(-1, *[1] * (start.dim() - 2))
            grads.append(grad)
        return grads

    announced = announced_steps(optimizer, group)
    note = (
        f"measured for {MAX_STEPS} steps, the longest measurement; its hyperparameters announce a change up to "
        f"step {announced - 2}, which no measurement reached"
        if announced > MAX_STEPS
        else ""
    )
    steps = min(announced, MAX_STEPS)
    return Case(starts, gradient, RANKS, steps, f"on small {_shapes(starts)} tensors", note)


def model_case(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    starts: list[torch.Tensor],
    firsts: list[torch.Tensor],
    ranks: int,
) -> Case:
    """The model's own parameters ``starts`` with their first gradients ``firsts`` (whole, float64),
    over the shard group's ``ranks``: the first step's gradient as it is, later ones drawn around it
    at its scale. As many steps as ``toy_case`` runs, within ``MODEL_BUDGET`` (at least ``STEPS``)."""
    wanted = probe_steps(optimizer, group)
    elements = sum(t.numel() for t in starts) or 1
    steps = min(wanted, max(STEPS, MODEL_BUDGET // elements))

    def gradient(step: int) -> list[torch.Tensor]:
        if step == 0:
            return [g.clone() for g in firsts]
        generator = torch.Generator().manual_seed(4321 + step)
        grads = []
        for start, first in zip(starts, firsts):
            scale = first.norm().item() / math.sqrt(max(first.numel(), 1)) or 1.0
            noise = torch.randn(start.shape, generator=generator, dtype=torch.float64) * scale
            grads.append(_varied(start, first + noise, step))
        return grads

    note = (
        f"measured on the model's {_shapes(starts)} parameters for {steps} steps, within its budget of "
        f"{MODEL_BUDGET:.3g} element-steps; its hyperparameters announce a change up to step {wanted - 2}, which "
        "was measured on small tensors only"
        if steps < wanted
        else ""
    )
    where = f"on the model's {_shapes(starts)} parameters over {ranks} ranks"
    return Case(starts, gradient, ranks, steps, where, note)


def _varied(start: torch.Tensor, grad: torch.Tensor, step: int) -> torch.Tensor:
    """``grad`` at step ``step``'s scale: as it is, along ``start`` (the weights) or orthogonal to it."""
    scale = STEP_SCALES[step % len(STEP_SCALES)]
    if step % 3 == 1:
        size = grad.norm() / (start.norm() + 1e-30)
        grad = start * size + 0.01 * grad
    elif step % 3 == 2:
        grad = grad - (grad * start).sum() / ((start * start).sum() + 1e-30) * start
    return grad * scale


def _shapes(tensors: list[torch.Tensor]) -> str:
    return ", ".join("x".join(map(str, t.shape)) or "scalar" for t in tensors)


def _moving(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with a learning rate that moves the tensors: a schedule's warmup from 0 would make every
    layout equal (nothing moves), and a rate of 0 says nothing of the update's form."""
    lr = group.get("lr")
    zero = torch.is_tensor(lr) and bool((lr == 0).all()) or (isinstance(lr, (int, float)) and lr == 0)
    return {**group, "lr": torch.full_like(lr, 1e-3) if torch.is_tensor(lr) else 1e-3} if zero else group


def _refuse_empty_groups(optimizer: torch.optim.Optimizer, group: dict[str, Any], case: Case) -> None:
    """Placed whole, a rank that owns none of a param group's parameters steps that group empty (the
    optimizer's ``step`` runs on every rank): an optimizer that cannot, or whose param group then keeps
    other values than where it steps parameters (a step counter of the group, a switch), is refused
    before its first step: the ranks' groups would differ, and a checkpoint holds rank 0's."""
    empty = build(optimizer, group, [])
    param = torch.nn.Parameter(case.starts[0].clone())
    param.grad = case.gradient(0)[0].clone()
    stepping = build(optimizer, group, [param])
    try:
        step_once(empty)
    except ProbeStopped as stopped:
        raise ProbeStopped(
            f"placed whole, a rank that owns none of a param group's parameters steps it empty, and {stopped}"
        ) from None
    step_once(stepping)
    values = [{k: v for k, v in probe.param_groups[0].items() if k != "params"} for probe in (stepping, empty)]
    for key in sorted(set(values[0]) | set(values[1]), key=str):
        if key not in values[0] or key not in values[1] or values_differ(values[0][key], values[1][key]):
            raise ProbeStopped(
                f"its param group's {key!r} changes in a step only where the group has parameters to step: placed "
                "whole, the ranks that own none of them would keep another value"
            )


# ---- layouts ---------------------------------------------------------------------------------------


class _Layout(NamedTuple):
    """How tensors are split among optimizer instances, and each tensor's pieces back."""

    split: Callable[[list[torch.Tensor], int], list[list[torch.Tensor]]]  # (tensors, ranks) -> per instance
    pieces: Callable[[int, int, int], list[tuple[int, int]]]  # (tensor index, tensors, ranks) -> (instance, slot)


_whole = _Layout(lambda tensors, ranks: [list(tensors)], lambda i, n, ranks: [(0, i)])
_per_param = _Layout(lambda tensors, ranks: [[t] for t in tensors], lambda i, n, ranks: [(i, 0)])


def _row_blocks(tensors: list[torch.Tensor], ranks: int) -> list[list[torch.Tensor]]:
    """Each rank's zero-padded row block of every tensor ([Note: shard layout])."""
    blocks: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    for tensor in tensors:
        rows_of = tensor.reshape(1) if tensor.dim() == 0 else tensor
        chunk = -(-rows_of.shape[0] // ranks)
        for rank in range(ranks):
            block = rows_of.new_zeros(chunk, *rows_of.shape[1:])
            rows = rows_of[rank * chunk : (rank + 1) * chunk]
            block[: rows.shape[0]] = rows
            blocks[rank].append(block)
    return blocks


_rows = _Layout(_row_blocks, lambda i, n, ranks: [(rank, i) for rank in range(ranks)])


class _Run:
    """``optimizer``'s class stepping ``case``'s tensors in one layout."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: dict[str, Any], case: Case, layout: _Layout):
        self.case, self.layout = case, layout
        pieces = layout.split(case.starts, case.ranks)
        self.params = [[torch.nn.Parameter(t.clone()) for t in piece] for piece in pieces]
        self.optimizers = [build(optimizer, group, params) for params in self.params]

    def step(self, step: int) -> None:
        for params, grads in zip(self.params, self.layout.split(self.case.gradient(step), self.case.ranks)):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
        for probe in self.optimizers:
            step_once(probe)

    def snapshot(self) -> dict[str, Any]:
        """What the optimizers keep, per measured tensor: its pieces' values and state; and per
        instance its param group's values and its own attributes."""
        count = len(self.case.starts)
        attributes = [_attributes(probe) for probe in self.optimizers]
        keyed = [
            {k: attrs.pop(k) for k in list(attrs) if _by_parameter(attrs[k], params)}
            for attrs, params in zip(attributes, self.params)
        ]
        tensors = []
        for index, start in enumerate(self.case.starts):
            pieces = self.layout.pieces(index, count, self.case.ranks)
            params = [self.params[i][slot] for i, slot in pieces]
            states = []
            for i, slot in pieces:
                param = self.params[i][slot]
                state = dict(self.optimizers[i].state.get(param, {}))
                for key, held in keyed[i].items():  # by the parameter or by its id (never compared as tensors)
                    for k, value in held.items():
                        if k is param or (isinstance(k, int) and k == id(param)):
                            state[f"{key}[parameter]"] = value
                states.append(state)
            tensors.append((start.shape, params, states))
        groups = [{k: v for k, v in probe.param_groups[0].items() if k != "params"} for probe in self.optimizers]
        return {"tensors": tensors, "groups": groups, "attributes": attributes}


def _attributes(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the optimizer keeps beside its parameters' state: its attributes (its ``defaults`` too),
    and entries of ``optimizer.state`` under keys that are not parameters (a global statistic)."""
    found = {k: v for k, v in vars(optimizer).items() if k not in ("param_groups", "state") and not torch_hooks(k)}
    found = {k: v for k, v in found.items() if not callable(v)}
    found.update({f"state[{k!r}]": v for k, v in optimizer.state.items() if not isinstance(k, torch.Tensor)})
    return found


def _by_parameter(value: Any, params: list[torch.Tensor]) -> bool:
    """An attribute that keeps something per parameter, keyed by the parameter object or its ``id``
    (state of its own)."""
    ids = {id(p) for p in params}
    return isinstance(value, dict) and bool(value) and all(isinstance(k, torch.Tensor) or k in ids for k in value)


def _compare(optimizer: torch.optim.Optimizer, group: dict[str, Any], case: Case, layout: _Layout) -> Difference:
    """Step whole and ``layout`` in lockstep; the first difference between what they keep, if any."""
    whole, other = _Run(optimizer, group, case, _whole), _Run(optimizer, group, case, layout)
    rows: dict[int, dict[str, tuple]] = {}  # per tensor, its state of its own shape as first kept
    for step in range(case.steps):
        whole.step(step)
        other.step(step)
        snapshot = whole.snapshot()
        found = snapshot_difference(snapshot, other.snapshot(), step)
        if not found.equal:
            return found
        _refuse_changing_rows(rows, snapshot, step)
    return Difference.none()


def _refuse_changing_rows(first: dict[int, dict[str, tuple]], snapshot: dict[str, Any], step: int) -> None:
    """Placed whole, the state of a parameter's shape it holds after its first step is kept in rows
    on every rank; one whose entry later goes or changes shape cannot be carried: refused."""
    for index, (shape, _, (state,)) in enumerate(snapshot["tensors"]):
        rows = {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v) and v.shape == shape}
        if index not in first:
            if state:
                first[index] = rows
            continue
        gone = [k for k in first[index] if k not in state or not torch.is_tensor(state[k]) or state[k].shape != shape]
        if gone:
            raise ProbeStopped(
                f"its state {gone} of a parameter's shape goes or changes shape at step {step + 1}, which placing "
                "a parameter whole cannot carry (that state is kept in rows on every rank)"
            )
