"""Copies of a user's optimizer for the probe ([Note: optimizers measured, not assumed] in
optimizer_probe.py): built without its state and without touching the model's tensors, stepped
where a collective or a random number stops the measurement."""

from __future__ import annotations

import copy
import inspect
from collections import OrderedDict, defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ProbeStopped(Exception):
    """The probe could not run the optimizer; the message says why (``ran``: False when its step raised
    on the tensors it was given, which may not be of the kinds it steps)."""

    def __init__(self, message: str, ran: bool = True) -> None:
        super().__init__(message)
        self.ran = ran


def build(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list) -> torch.optim.Optimizer:
    """A fresh optimizer like ``optimizer`` (its attributes copied, not its state) over ``params`` with
    ``group``'s hyperparameters; else one built by its class from them."""
    hyper = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
    try:
        probe = _like(optimizer)
        probe.add_param_group({"params": params, **hyper})
        return probe
    except ProbeStopped:
        raise
    except Exception:  # noqa: BLE001 - an optimizer that cannot be copied so is built by its class
        pass
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    keywords = {name: value for name, value in hyper.items() if name in accepted and name != "params"}
    try:
        return cls([{"params": params, **hyper}], **keywords)
    except Exception as error:  # noqa: BLE001 - the reason the probe stops
        raise ProbeStopped(
            f"it could not be built again from its param group's hyperparameters to be measured "
            f"({type(error).__name__}: {error})"
        ) from None


def refuse_random_construction(optimizer: torch.optim.Optimizer, group: dict[str, Any], starts: list) -> None:
    """An optimizer that draws random numbers when it is built (SPAM's update masks) drew them for your
    shards, not your parameters: no layout reproduces one process's. Built by its class from the param
    group's hyperparameters; one that cannot be built so is not judged here."""
    cls = type(optimizer)
    hyper = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
    keywords = {k: v for k, v in hyper.items() if k in inspect.signature(cls.__init__).parameters and k != "params"}
    before = torch.random.get_rng_state()
    try:
        cls([{"params": [torch.nn.Parameter(t.clone()) for t in starts], **hyper}], **keywords)
    except Exception:  # noqa: BLE001 - the probe's copy (``_like``) measures it without its constructor
        return
    if not torch.equal(before, torch.random.get_rng_state()):
        raise ProbeStopped("it draws random numbers when it is built (for your shards, not your parameters)")


def torch_hooks(key: str) -> bool:
    """Whether ``key`` is one of torch's hook registries of an optimizer (``_optimizer_step_pre_hooks``,
    ``_optimizer_load_state_dict_post_hooks``, ...), which a copy starts empty."""
    return key.startswith("_optimizer_") and key.endswith("hooks")


def _holding(optimizer: torch.optim.Optimizer, kind: type) -> str | None:
    """The attribute of ``optimizer`` that holds a ``kind`` (another optimizer: a wrapper such as Lookahead or
    OrthoGrad; a module), directly or in a list, tuple or dict, if any."""
    for key, value in vars(optimizer).items():
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, kind) for v in values):
            return key
    return None


def _like(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` without its param groups, state and hooks (its tensors not copied; its
    bound methods bound to the copy; what an LR scheduler set over ``step`` left out)."""
    wrapped = _holding(optimizer, torch.optim.Optimizer)
    if wrapped is not None:
        raise ProbeStopped(
            f"it wraps another optimizer (its attribute {wrapped!r}), which holds your parameters: a copy to "
            "measure would step them"
        )
    module = _holding(optimizer, torch.nn.Module)
    if module is not None:  # a deep copy of a sharded model (its hooks, groups, freed storage) crashed the process
        raise ProbeStopped(
            f"it holds a module (its attribute {module!r}): a copy to measure would copy your sharded model, or step it"
        )
    tensors = [t for group in optimizer.param_groups for t in group["params"]]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    held = {id(t): torch.empty_like(t, device="meta") for t in tensors}  # never the model's own tensors
    cls = type(optimizer)
    skipped = ("param_groups", "state", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    attributes, bound = {}, {}
    for key, value in vars(optimizer).items():
        if key in skipped or torch_hooks(key) or callable(getattr(cls, key, None)):
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
        if torch_hooks(key) and key not in probe.__dict__:
            probe.__dict__[key] = OrderedDict()
    return probe


class _NoCommunication(TorchDispatchMode):
    """Stops a probe's step at its first collective: an optimizer that communicates (DistributedMuon)
    would meet the other ranks' collectives with tensors of another size, or none."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            raise ProbeStopped(
                f"it communicates in its step ({func.name()}): it would meet the other ranks' collectives with "
                "another rank's tensors"
            )
        return func(*args, **(kwargs or {}))


def step(optimizer: torch.optim.Optimizer) -> None:
    before = torch.random.get_rng_state()
    try:
        with _NoCommunication():
            optimizer.step()
    except ProbeStopped:
        raise
    except Exception as error:  # noqa: BLE001 - the reason the probe stops
        if "closure" in str(error).lower():
            raise ProbeStopped(f"it needs a closure ({type(error).__name__}: {error})") from None
        raise ProbeStopped(f"its step raised ({type(error).__name__}: {error})", ran=False) from None
    if not torch.equal(before, torch.random.get_rng_state()):
        raise ProbeStopped("it draws random numbers in its step, so no two layouts of the same step can be compared")
