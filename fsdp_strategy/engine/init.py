"""Deferred initialization: modules created on the meta device are materialized unit by unit.

A module whose own parameters or buffers are on the meta device is initialized, just before
its unit is sharded (so peak memory is about one unit's full size, not the model's), by:
1. ``param_init_fn(module)`` when given (FSDP1's meaning: it allocates the module's own meta
   tensors, e.g. with ``module.to_empty(device=..., recurse=False)``, and initializes them);
2. otherwise the engine allocates them on the compute device, filled with NaN, and calls the
   module's ``reset_parameters()`` if it has one, then the ``_init_weights(module)`` of the
   nearest enclosing module that defines it (Hugging Face models: it initializes norms,
   rotary frequencies and ``Conv1D`` too). A floating tensor still NaN afterwards was
   initialized by nothing: that is an error naming it, as is a module neither can initialize.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fsdp_strategy.engine.param import ParamUse

ParamInitFn = Callable[[nn.Module], None]


def _meta_names(prefix: str, module: nn.Module) -> list[str]:
    tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return [f"{prefix}{name}" for name, tensor in tensors if tensor.is_meta]


def meta_tensor_names(root: nn.Module) -> list[str]:
    """Qualified names of every parameter and buffer of ``root`` still on the meta device."""
    return [
        name for prefix, module in root.named_modules() for name in _meta_names(f"{prefix}." if prefix else "", module)
    ]


def weight_initializers(root: nn.Module) -> dict[int, Callable[[nn.Module], None]]:
    """Module id -> the ``_init_weights`` of its nearest enclosing module defining one (itself included)."""
    found: dict[int, Callable[[nn.Module], None]] = {}

    def visit(module: nn.Module, inherited: Callable[[nn.Module], None] | None) -> None:
        own = getattr(module, "_init_weights", None)
        initializer = own if callable(own) else inherited
        if initializer is not None:
            found.setdefault(id(module), initializer)
        for child in module.children():
            visit(child, initializer)

    visit(root, None)
    return found


def _allocate_meta(module: nn.Module, device: torch.device) -> list[str]:
    """Replace the module's own meta tensors by NaN-filled ones on ``device``; return their names."""
    allocated = []
    with torch.no_grad():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None or not tensor.is_meta:
                    continue
                fresh = torch.empty_like(tensor, device=device)
                if fresh.is_floating_point():
                    fresh.fill_(float("nan"))
                else:
                    fresh.zero_()
                if isinstance(tensor, nn.Parameter):
                    fresh = nn.Parameter(fresh, requires_grad=tensor.requires_grad)
                store[name] = fresh
                allocated.append(name)
    return allocated


def _keep_ties(module: nn.Module, before: dict[str, nn.Parameter], uses: dict[int, list[ParamUse]]) -> None:
    """Register each newly materialized parameter at every other place its meta original was (ties)."""
    for name, original in before.items():
        fresh = module._parameters.get(name)
        if fresh is None or fresh is original:
            continue
        for use in uses.get(id(original), []):
            if use.module._parameters.get(use.name) is original:
                use.module._parameters[use.name] = fresh


def materialize(
    modules: list[tuple[str, nn.Module]],
    device: torch.device,
    param_init_fn: ParamInitFn | None = None,
    initializers: dict[int, Callable[[nn.Module], None]] | None = None,
    uses: dict[int, list[ParamUse]] | None = None,
) -> None:
    """Allocate and initialize every listed module that holds meta tensors (not recursive).

    ``uses`` (original parameter id -> its registrations) keeps tied parameters tied.
    Raises ValueError naming every tensor that nothing initialized.
    """
    stuck: list[str] = []
    for prefix, module in modules:
        dotted = f"{prefix}." if prefix else ""
        if not _meta_names(dotted, module):
            continue
        before = {name: p for name, p in module._parameters.items() if p is not None and p.is_meta}
        stuck.extend(_initialize(module, dotted, device, param_init_fn, (initializers or {}).get(id(module))))
        _keep_ties(module, before, uses or {})
    if stuck:
        raise ValueError(
            f"cannot initialize {stuck} from the meta device: their modules have no reset_parameters(), no enclosing "
            "_init_weights() covers them, or it left them uninitialized. Pass param_init_fn (called on each module "
            "with meta tensors; it allocates them, e.g. module.to_empty(device=..., recurse=False), and initializes "
            "them), give the module a reset_parameters(), or create these tensors on a real device"
        )


def _initialize(
    module: nn.Module,
    dotted: str,
    device: torch.device,
    param_init_fn: ParamInitFn | None,
    hf_init: Callable[[nn.Module], None] | None,
) -> list[str]:
    """Initialize one module's own meta tensors; return the names nothing initialized."""
    if param_init_fn is not None:
        with torch.no_grad():
            param_init_fn(module)
        return _meta_names(dotted, module)
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset) and hf_init is None:
        return _meta_names(dotted, module)
    names = _allocate_meta(module, device)
    with torch.no_grad():
        if callable(reset):
            reset()
        if hf_init is not None:
            hf_init(module)
    tensors = {**module._parameters, **module._buffers}
    return [
        f"{dotted}{name}" for name in names if tensors[name].is_floating_point() and torch.isnan(tensors[name]).any()
    ]
