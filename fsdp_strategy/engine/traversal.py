"""Find and replace the tensors inside a module's inputs or outputs (or a batch).

Containers traversed: tuple, list, dict (any Mapping subclass rebuilt as a dict of the same type
where possible, a ``defaultdict`` with its factory), NamedTuple and dataclass instances (Hugging
Face ``ModelOutput`` is both a dataclass and an OrderedDict). Anything else is a leaf: a tensor
inside a custom object is not seen. Both walks visit the tensors in the same order.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch

_MAX_DEPTH = 32


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def grad_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor that requires grad in ``value``, in traversal order."""
    found: list[torch.Tensor] = []
    _collect(value, found, 0)
    return found


def _collect(value: Any, found: list[torch.Tensor], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise RuntimeError(f"module inputs/outputs nest deeper than {_MAX_DEPTH} levels (a reference cycle?)")
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            found.append(value)
    elif _is_namedtuple(value) or isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found, depth + 1)
    elif _is_dataclass_instance(value):
        for field in dataclasses.fields(value):
            _collect(getattr(value, field.name), found, depth + 1)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect(item, found, depth + 1)


def replace_grad_tensors(value: Any, replacements: list[torch.Tensor]) -> Any:
    """``value`` with its grad-requiring tensors replaced, in traversal order, by ``replacements``.

    Containers that hold no replaced tensor are returned as they are (same object).
    """
    iterator = iter(replacements)
    result = map_tensors(value, lambda tensor: next(iterator) if tensor.requires_grad else tensor)
    if next(iterator, None) is not None:
        raise RuntimeError("more replacement tensors than tensors requiring grad")
    return result


def map_tensors(value: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``function`` applied to each of its tensors, in traversal order; containers
    that hold no changed tensor are returned as they are (same object)."""
    return _map(value, function, 0)


def _map(value: Any, function: Callable[[torch.Tensor], torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise RuntimeError(f"module inputs/outputs nest deeper than {_MAX_DEPTH} levels (a reference cycle?)")
    if isinstance(value, torch.Tensor):
        return function(value)
    if _is_namedtuple(value):
        items = [_map(item, function, depth + 1) for item in value]
        return value if all(a is b for a, b in zip(items, value)) else type(value)(*items)
    if isinstance(value, (list, tuple)):
        items = [_map(item, function, depth + 1) for item in value]
        return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
    if _is_dataclass_instance(value):
        changes = {}
        for field in dataclasses.fields(value):
            old = getattr(value, field.name)
            new = _map(old, function, depth + 1)
            if new is not old:
                changes[field.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, Mapping):
        items = {key: _map(item, function, depth + 1) for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        if isinstance(value, defaultdict):
            return defaultdict(value.default_factory, items)
        return type(value)(items) if isinstance(value, dict) else items
    return value
