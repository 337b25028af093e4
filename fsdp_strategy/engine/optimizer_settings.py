"""What an optimizer's settings tell the measurement of its kind ([Note: measure what will run] in
optimizer_kinds.py): for how many steps to run it (hyperparameters that announce a later change), and
what may switch its update between steps (its param groups' values but what schedulers write,
``SCHEDULED``, and its own attributes, each by its regime), with a hashable stand-in for a value.
"""

from __future__ import annotations

from typing import Any

import torch

STEPS = 8  # a measurement's steps when nothing announces a later change
MAX_STEPS = 2048  # the longest probe: an optimizer that changes its update after N steps is run past N
OTHER_INTS = 64  # an integer hyperparameter not named as a step count (a history length; a dimension) runs at most this
DELAY_WORDS = ("step", "freq", "interval", "iteration", "every", "warm")  # hyperparameters that count steps


def probe_steps(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """``announced_steps``, up to ``MAX_STEPS``."""
    return min(announced_steps(optimizer, group), MAX_STEPS)


def announced_steps(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """``STEPS``, or past the largest integer hyperparameter of the param group and of the optimizer
    whose name counts steps (a preconditioner first computed at step 1000), and past any other
    integer of the param group up to ``OTHER_INTS`` (a history of ``keep_num`` gradients; a dimension
    such as ``max_precond_dim`` costs no more than that)."""

    def counted(key: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            return 0
        return value if any(word in key.lower() for word in DELAY_WORDS) else min(value, OTHER_INTS)

    counts = [counted(key, value) for key, value in group.items()]
    counts += [
        counted(key, value) for key, value in vars(optimizer).items() if any(w in key.lower() for w in DELAY_WORDS)
    ]
    return max([STEPS, *(count + 2 for count in counts if count)])


SCHEDULED = frozenset(
    {"lr", "initial_lr", "max_lr", "min_lr", "base_lr", "momentum", "betas", "base_momentum", "max_momentum"}
)  # what torch's LR schedulers (and OneCycleLR's momentum cycle) write between steps: not measured again


def settings_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per param group, its values but ``params`` and ``SCHEDULED``, then the optimizer's own scalar
    and tensor attributes, each by its regime (``regime``): what may switch a branch."""
    groups = [
        {key: regime(value) for key, value in group.items() if key != "params" and key not in SCHEDULED}
        for group in optimizer.param_groups
    ]
    attributes = {  # a number by its sign, an integer too (a step count a callback writes on it)
        key: regime(float(value) if isinstance(value, int) and not isinstance(value, bool) else value)
        for key, value in vars(optimizer).items()
        if key not in ("param_groups", "state", "defaults")
        and (torch.is_tensor(value) or value is None or isinstance(value, (bool, int, float, str)))
    }
    return [*groups, attributes]


def regime(value: Any) -> Any:
    """What a change of ``value`` between steps must be measured again for: a float by its sign (a
    weight decay raised from 0 switches AdamS's branch; a decay schedule from 0.05 to 0.04 does not,
    nor does NaN, equal to itself here); a tensor by identity and version (an in-place ``fill_``
    counts, and nothing is read); anything else by value."""
    if isinstance(value, float):
        return "nan" if value != value else (value > 0) - (value < 0)
    if torch.is_tensor(value):
        return ("tensor", id(value), value._version)
    if isinstance(value, (list, tuple)):
        return tuple(regime(item) for item in value)
    return frozen(value)


def frozen(value: Any) -> Any:
    """A hashable stand-in for a hyperparameter value (tensors by value, containers by content)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    if torch.is_tensor(value):  # a hyperparameter by value; a large tensor (the model's) by its kind
        if value.numel() > 64 or value.device.type == "meta":
            return ("tensor", tuple(value.shape), str(value.dtype), id(value))
        return ("tensor", tuple(value.detach().cpu().reshape(-1).tolist()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
