"""Deferred initialization: modules created on the meta device are materialized unit by unit.

A module whose own parameters or buffers are on the meta device is allocated on the target
device (``to_empty``) and initialized by its ``reset_parameters()``; the engine shards the
unit right after, so peak memory is about one unit's full size, not the model's. A module on
the meta device without ``reset_parameters()`` cannot be initialized: that is an error.
"""

from __future__ import annotations

import torch
from torch import nn


def _meta_names(prefix: str, module: nn.Module) -> list[str]:
    tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return [f"{prefix}{name}" for name, tensor in tensors if tensor.is_meta]


def meta_tensor_names(root: nn.Module) -> list[str]:
    """Qualified names of every parameter and buffer of ``root`` still on the meta device."""
    return [
        name for prefix, module in root.named_modules() for name in _meta_names(f"{prefix}." if prefix else "", module)
    ]


def materialize(modules: list[tuple[str, nn.Module]], device: torch.device) -> None:
    """Allocate and initialize every listed module that holds meta tensors (not recursive).

    Raises ValueError naming the tensors that no ``reset_parameters()`` can initialize.
    """
    stuck: list[str] = []
    for prefix, module in modules:
        names = _meta_names(f"{prefix}." if prefix else "", module)
        if not names:
            continue
        if not callable(getattr(module, "reset_parameters", None)):
            stuck.extend(names)
            continue
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            module.reset_parameters()
    if stuck:
        raise ValueError(
            f"parameters left on the meta device: {stuck}. Their modules have no reset_parameters() to "
            "initialize them; create them on a real device or give the module a reset_parameters()"
        )
