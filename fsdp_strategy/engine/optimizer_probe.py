"""Measuring an optimizer the engine does not know, before its first step.

[Note: optimizers measured, not assumed]
Each rank steps only its rows of a parameter. Whether that is exact depends on what the update of
an element reads, which no name or warning can tell. So an optimizer class the engine does not
know is measured, once per class and param group's hyperparameters, on small CPU tensors shaped
like a model's kinds of parameters (a 7 x 6 matrix, whose rows split unevenly over 2 and 3 ranks,
and a vector of 6), in float64, over ``STEPS`` steps (or past the largest hyperparameter that
counts steps: a preconditioner first computed at step 1000 is run to step 1002; any other integer
of the param group, up to 64, e.g. a history of ``keep_num`` gradients) whose gradients differ by row,
by column and by step (one step's far larger than the others', so a clip or a running statistic
that is uniform at the first step shows; others along the weights or orthogonal to them, so a
branch on their cosine shows). A learning rate of 0 (a warmup's first step) is measured as 1e-3.
The optimizer is copied without its state (its attributes kept, so settings outside its param
groups are measured too; tensors of the model it refers to replaced by meta stand-ins, so the probe
can never touch them); one that wraps another optimizer (Lookahead, OrthoGrad) is refused, to be
declared. Three layouts step from the same start:
- whole: one instance of the optimizer over both tensors;
- rows: one instance per rank over that rank's padded shards ([Note: shard layout] at 3 ranks):
  what stepping shards does;
- per parameter: one instance per tensor.
Rows equal to whole: the update is elementwise, shards step as they are. Otherwise, per parameter
equal to whole: the update of a parameter reads that parameter only (a norm, row and column
statistics, a preconditioner), and it is exact placed whole ([Note: whole-matrix placement]).
Otherwise the update of one parameter depends on the others (Prodigy's and D-Adaptation's global
``d``): refused. An optimizer the probe cannot run (it needs a closure, it draws random numbers,
it cannot be built from its param group, its step raises) is refused naming what stopped it.
"Equal" is within ``RTOL`` in float64, far below float32's rounding: a measured difference is
structural. Every rank measures the same tensors with the same code, and the ranks then agree on
the result (one small object gather at an optimizer's first step).
Costs: three small optimizers for ``STEPS`` steps on a few hundred elements, milliseconds per
class and hyperparameters (seconds for a probe of a thousand steps); the global random state is
saved and restored around it. What it cannot see: a change of behaviour that no step-counting
hyperparameter announces and that comes later than the probe's last step.
"""

from __future__ import annotations

import copy
import inspect
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fsdp_strategy.options import UpdateKind

SHAPES = ((7, 6), (6,))  # a matrix whose rows split unevenly over 2 and 3 ranks, and a vector
RANKS = 3  # the row blocks: shards of SHAPES over 3 ranks, zero-padded as the engine pads them
STEPS = 8
STEP_SCALES = (1.0, 50.0, 0.02, 1.0)  # a step with far larger gradients: clips and running statistics show
MAX_STEPS = 2048  # the longest probe: an optimizer that changes its update after N steps is run past N
OTHER_INTS = 64  # an integer hyperparameter not named as a step count (a history length; a dimension) runs at most this
DELAY_WORDS = ("step", "freq", "interval", "iteration", "every")  # hyperparameters that count steps
RTOL, ATOL = 1e-8, 1e-12


class Measured(NamedTuple):
    """What the probe found: a kind, or None (refused) and why."""

    kind: UpdateKind | None
    reason: str  # what was measured, or what stopped the measurement


def measure(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> Measured:
    """Measure ``optimizer``'s class with ``group``'s hyperparameters ([Note: optimizers measured, not
    assumed]). Never raises for the optimizer's own failures: they are the reason it is refused."""
    state = torch.random.get_rng_state()
    steps = probe_steps(optimizer, group)
    group = _moving(group)
    try:
        whole = _trajectory(optimizer, group, _whole, steps)
        rows = _trajectory(optimizer, group, _rows, steps)
        if _equal(whole, rows):
            return Measured(UpdateKind.ELEMENTWISE, "its update of an element reads that element only")
        per_param = _trajectory(optimizer, group, _per_param, steps)
        if _equal(whole, per_param):
            return Measured(
                UpdateKind.WHOLE_MATRIX,
                f"stepping rows of a parameter changes its update (by up to {_difference(whole, rows):.2g} "
                "relative), stepping each parameter alone does not: it reads whole parameters",
            )
        return Measured(
            None,
            "the update of one parameter depends on the others: stepping each parameter with its own instance "
            f"gave other values than stepping them together (by up to {_difference(whole, per_param):.2g} relative)",
        )
    except _Stopped as stopped:
        return Measured(None, str(stopped))
    finally:
        torch.random.set_rng_state(state)


class _Stopped(Exception):
    """The probe could not run the optimizer; the message says why."""


def _starts() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]


def probe_steps(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """``STEPS``, or past the largest integer hyperparameter of the param group and of the optimizer
    whose name counts steps (a preconditioner first computed at step 1000), up to ``MAX_STEPS``, and
    past any other integer of the param group up to ``OTHER_INTS`` (a history of ``keep_num``
    gradients; a dimension such as ``max_precond_dim`` costs no more than that)."""

    def counted(key: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            return 0
        return value if any(word in key.lower() for word in DELAY_WORDS) else min(value, OTHER_INTS)

    counts = [counted(key, value) for key, value in group.items()]
    counts += [
        counted(key, value) for key, value in vars(optimizer).items() if any(w in key.lower() for w in DELAY_WORDS)
    ]
    return min(max([STEPS, *(count + 2 for count in counts if count)]), MAX_STEPS)


def _moving(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with a learning rate that moves the tensors: a schedule's warmup from 0 would make every
    layout equal (nothing moves), and a rate of 0 says nothing of the update's form."""
    lr = group.get("lr")
    zero = torch.is_tensor(lr) and bool((lr == 0).all()) or (isinstance(lr, (int, float)) and lr == 0)
    return {**group, "lr": torch.full_like(lr, 1e-3) if torch.is_tensor(lr) else 1e-3} if zero else group


def _gradients(steps: int) -> list[list[torch.Tensor]]:
    """Per step, a gradient per tensor, scaled by row, column and step: random, then along the starting
    tensors, then orthogonal to them (branches on the cosine of gradient and weight show)."""
    generator = torch.Generator().manual_seed(4321)
    starts = _starts()
    sequence = []
    for step in range(steps):
        scale = STEP_SCALES[step % len(STEP_SCALES)]
        grads = []
        for shape, start in zip(SHAPES, starts):
            grad = torch.randn(shape, generator=generator, dtype=torch.float64) * scale
            if step % 3 == 1:
                grad = start * scale + 0.01 * grad
            elif step % 3 == 2:
                grad = grad - (grad * start).sum() / (start * start).sum() * start
            rows = torch.logspace(-1, 1, shape[0], dtype=torch.float64)
            grad *= rows.view(-1, *([1] * (len(shape) - 1)))
            if len(shape) > 1:
                grad *= torch.logspace(0.5, -0.5, shape[1], dtype=torch.float64)
            grads.append(grad)
        sequence.append(grads)
    return sequence


Layout = Callable[[list[torch.Tensor]], list[list[torch.Tensor]]]  # tensors -> each instance's tensors


def _whole(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [tensors]


def _per_param(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [[tensor] for tensor in tensors]


def _rows(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each rank's zero-padded row block of every tensor ([Note: shard layout])."""
    blocks: list[list[torch.Tensor]] = [[] for _ in range(RANKS)]
    for tensor in tensors:
        chunk = -(-tensor.shape[0] // RANKS)
        for rank in range(RANKS):
            block = tensor.new_zeros(chunk, *tensor.shape[1:])
            rows = tensor[rank * chunk : (rank + 1) * chunk]
            block[: rows.shape[0]] = rows
            blocks[rank].append(block)
    return blocks


def _join(layout: Layout, instances: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The tensors back in ``SHAPES`` from ``layout``'s pieces (padding rows dropped)."""
    if layout is _whole:
        return [t.detach().clone() for t in instances[0]]
    if layout is _per_param:
        return [pieces[0].detach().clone() for pieces in instances]
    joined = []
    for index, shape in enumerate(SHAPES):
        joined.append(torch.cat([instance[index].detach() for instance in instances])[: shape[0]].clone())
    return joined


def _trajectory(optimizer: torch.optim.Optimizer, group: dict[str, Any], layout: Layout, steps: int) -> list:
    """The tensors after each step of ``optimizer``'s class in ``layout``."""
    params = [[torch.nn.Parameter(t) for t in pieces] for pieces in layout(_starts())]
    optimizers = [_build(optimizer, group, pieces) for pieces in params]
    trajectory = []
    for grads in _gradients(steps):
        for pieces, grad_pieces in zip(params, layout(grads)):
            for param, grad in zip(pieces, grad_pieces):
                param.grad = grad.clone()
        for probe in optimizers:
            _step(probe)
        trajectory.append(_join(layout, params))
    return trajectory


def _build(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list) -> torch.optim.Optimizer:
    """A fresh optimizer like ``optimizer`` (its attributes copied, not its state) over ``params`` with
    ``group``'s hyperparameters; else one built by its class from them."""
    hyper = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
    try:
        probe = _like(optimizer)
        probe.add_param_group({"params": params, **hyper})
        return probe
    except _Stopped:
        raise
    except Exception:  # noqa: BLE001 - an optimizer that cannot be copied so is built by its class
        pass
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    keywords = {name: value for name, value in hyper.items() if name in accepted and name != "params"}
    try:
        return cls([{"params": params, **hyper}], **keywords)
    except Exception as error:  # noqa: BLE001 - the reason the probe stops
        raise _Stopped(
            f"it could not be built again from its param group's hyperparameters to be measured "
            f"({type(error).__name__}: {error})"
        ) from None


def _wrapped(optimizer: torch.optim.Optimizer) -> str | None:
    """The attribute of ``optimizer`` that holds another optimizer (a wrapper: Lookahead, OrthoGrad), if any."""
    for key, value in vars(optimizer).items():
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.optim.Optimizer) for v in values):
            return key
    return None


def _like(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` without its param groups, state and hooks (its tensors not copied; its
    bound methods bound to the copy; what an LR scheduler set over ``step`` left out)."""
    wrapped = _wrapped(optimizer)
    if wrapped is not None:
        raise _Stopped(
            f"it wraps another optimizer (its attribute {wrapped!r}), which holds your parameters: a copy to "
            "measure would step them"
        )
    tensors = [t for group in optimizer.param_groups for t in group["params"]]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    held = {id(t): torch.empty_like(t, device="meta") for t in tensors}  # never the model's own tensors
    cls = type(optimizer)
    skipped = ("param_groups", "state", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    attributes, bound = {}, {}
    for key, value in vars(optimizer).items():
        if key in skipped or "hook" in key or callable(getattr(cls, key, None)):
            continue  # an instance attribute over a method (an LR scheduler's wrapper of ``step``) calls the original
        if getattr(value, "__self__", None) is optimizer:
            bound[key] = value.__func__  # a method of the original, bound to the copy below
        else:
            attributes[key] = value
    probe = cls.__new__(cls)
    probe.__dict__.update(copy.deepcopy(attributes, memo=dict(held)))
    probe.__dict__.update({key: func.__get__(probe, cls) for key, func in bound.items()})
    probe.__dict__.update(param_groups=[], state=defaultdict(dict))
    probe._optimizer_step_pre_hooks = OrderedDict()
    probe._optimizer_step_post_hooks = OrderedDict()
    for key in vars(optimizer):
        if "hook" in key and key not in probe.__dict__:
            probe.__dict__[key] = OrderedDict()
    return probe


def _step(optimizer: torch.optim.Optimizer) -> None:
    before = torch.random.get_rng_state()
    try:
        optimizer.step()
    except Exception as error:  # noqa: BLE001 - the reason the probe stops
        closure = "closure" in str(error).lower()
        why = "it needs a closure" if closure else "its step raised on the probe's tensors"
        raise _Stopped(f"{why} ({type(error).__name__}: {error})") from None
    if not torch.equal(before, torch.random.get_rng_state()):
        raise _Stopped("it draws random numbers in its step, so no two layouts of the same step can be compared")


def _equal(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(
        torch.allclose(x, y, rtol=RTOL, atol=ATOL, equal_nan=True)
        for step_a, step_b in zip(a, b)
        for x, y in zip(step_a, step_b)
    )


def _difference(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    worst = 0.0
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b):
            worst = max(worst, ((x - y).abs() / (1e-12 + x.abs())).nan_to_num(nan=float("inf")).max().item())
    return worst
