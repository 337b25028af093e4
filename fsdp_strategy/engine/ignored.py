"""``ignored_modules`` (FSDP1's argument): modules whose parameters the engine leaves alone.

[Note: ignored modules]
Parameters of an ignored module (and of everything below it) are not sharded, gathered or
reduced: every rank keeps the whole tensor on the compute device, and its gradient stays this
rank's own (FSDP1's meaning: freeze them, or synchronize them yourself). Buffers below it keep
their dtype (no ``buffer_dtype`` cast). Checkpoints hold them whole (rank 0's values),
optimizers step on them like any parameter, and gradient clipping counts their local norm, as
FSDP1's ``clip_grad_norm_`` does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import NamedTuple

from torch import nn


class Ignored(NamedTuple):
    """The ignored subtrees of a model."""

    roots: list[nn.Module]  # the modules given
    module_ids: frozenset[int]  # every module below them, themselves included
    params: dict[str, nn.Parameter]  # first qualified name -> parameter


def find_ignored(root: nn.Module, ignored_modules: Iterable[nn.Module] | None) -> Ignored:
    """Check ``ignored_modules`` against ``root`` and collect what they hold."""
    if ignored_modules is None:
        return Ignored([], frozenset(), {})
    if isinstance(ignored_modules, nn.Module) or not isinstance(ignored_modules, Iterable):
        raise TypeError(f"ignored_modules must be a list of modules, got {type(ignored_modules).__name__}")
    roots = list(ignored_modules)
    inside = {id(m) for m in root.modules()}
    for module in roots:
        if not isinstance(module, nn.Module):
            raise TypeError(f"ignored_modules must hold nn.Module objects, got {type(module).__name__}")
        if module is root:
            raise ValueError(f"ignored_modules: {type(module).__name__} is the model itself")
        if id(module) not in inside:
            raise ValueError(f"ignored_modules: {type(module).__name__} is not a submodule of the model")
    module_ids = frozenset(id(m) for module in roots for m in module.modules())
    params: dict[str, nn.Parameter] = {}
    managed: set[int] = set()
    for name, module in root.named_modules(remove_duplicate=False):
        for param_name, param in module._parameters.items():
            if param is None:
                continue
            if id(module) in module_ids:
                params.setdefault(f"{name}.{param_name}" if name else param_name, param)
            else:
                managed.add(id(param))
    shared = sorted(name for name, param in params.items() if id(param) in managed)
    if shared:
        raise ValueError(f"ignored_modules: parameters {shared} are also used by modules that are not ignored")
    if any(param.requires_grad for param in params.values()):
        warnings.warn(
            "ignored_modules hold trainable parameters: their gradients are not synchronized across ranks "
            "(FSDP1's meaning). Freeze them, or all-reduce their gradients yourself",
            stacklevel=3,
        )
    return Ignored(roots, module_ids, params)
