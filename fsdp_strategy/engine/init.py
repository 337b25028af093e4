"""Deferred initialization: modules created on the meta device are materialized unit by unit.

The modules of a unit that hold tensors on the meta device are initialized, just before the unit
is sharded (so peak memory is about one unit's full size, not the model's), by:
1. ``param_init_fn(module)`` when given (FSDP1's meaning: it allocates the module's own meta
   tensors, e.g. with ``module.to_empty(device=..., recurse=False)``, and initializes them);
2. otherwise the library's own initialization, in its own order: the engine allocates each
   module's meta tensors on the compute device, filled with NaN, and calls its
   ``reset_parameters()`` if it has one (what its constructor would have done); then, as Hugging
   Face's ``initialize_weights`` does, the ``_init_weights`` of the nearest enclosing module that
   defines one is called on every module of the unit whose subtree was on the meta device,
   children before parents, so a parent's rescaling of its children (GPT-2's ``c_proj``) happens
   after the children's own initialization; but not on a module whose ``reset_parameters`` was
   assigned to the instance: that is its user's own initialization (LitGPT's pretraining sets
   its GPT-NeoX init so, for FSDP to apply), and it stays. A floating tensor still NaN afterwards, or another
   (integer, bool) still the allocated one, unwritten, was initialized by nothing: that is an
   error naming it, as is a module neither can initialize.
An ``_init_weights`` that changes tensors of another unit (a parent whose child is a unit of its
own) cannot reach them: keep such a child in its parent's unit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fsdp_strategy.engine.param import ParamUse

UNWRITTEN_BYTE = 0xA5  # what a non-floating tensor materialized from the meta device holds until written

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


def _allocate_meta(module: nn.Module, device: torch.device) -> dict[str, tuple[torch.Tensor, int]]:
    """Replace the module's own meta tensors by fresh ones on ``device`` (floating and complex: NaN;
    others: every byte ``UNWRITTEN_BYTE``); return ``name -> (tensor, its version now)``: a
    non-floating tensor nothing wrote to has the same object, version and bytes afterwards."""
    allocated = {}
    with torch.no_grad():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None or not tensor.is_meta:
                    continue
                fresh = torch.empty_like(tensor, device=device)
                if fresh.is_floating_point() or fresh.is_complex():
                    fresh.fill_(complex(float("nan"), float("nan")) if fresh.is_complex() else float("nan"))
                else:
                    fresh.reshape(-1).view(torch.uint8).fill_(UNWRITTEN_BYTE)
                if isinstance(tensor, nn.Parameter):
                    fresh = nn.Parameter(fresh, requires_grad=tensor.requires_grad)
                store[name] = fresh
                allocated[name] = (fresh, fresh._version)
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


def post_order(root: nn.Module) -> list[nn.Module]:
    """Every module of ``root`` once, children before their parent (``nn.Module.apply``'s order)."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                visit(child)
        order.append(module)

    visit(root)
    return order


def materialize(
    modules: list[tuple[str, nn.Module]],
    device: torch.device,
    param_init_fn: ParamInitFn | None = None,
    initializers: dict[int, Callable[[nn.Module], None]] | None = None,
    uses: dict[int, list[ParamUse]] | None = None,
    order: list[nn.Module] | None = None,
) -> None:
    """Allocate and initialize the listed modules (one unit's) that hold meta tensors.

    ``uses`` (original parameter id -> its registrations, the first first) keeps tied parameters
    tied, and a tied parameter keeps the value its first registration's initialization gave it
    (an input embedding, not the output layer tied to it: Hugging Face initializes before it ties);
    ``order`` (``post_order`` of the model) is the order the initializers run in. Raises
    ValueError naming every tensor that nothing initialized.
    """
    initializers = initializers or {}
    stuck: list[str] = []
    on_meta = [(prefix, module) for prefix, module in modules if _meta_names(_dotted(prefix), module)]
    if param_init_fn is not None:
        for prefix, module in on_meta:
            before = _meta_params(module)
            with torch.no_grad():
                param_init_fn(module)
            _keep_ties(module, before, uses or {})
            stuck.extend(_meta_names(_dotted(prefix), module))
        _raise_if_stuck(stuck)
        return
    allocated: list[tuple[str, nn.Module, dict[str, tuple[torch.Tensor, int]]]] = []
    for prefix, module in on_meta:
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset) and id(module) not in initializers:
            stuck.extend(_meta_names(_dotted(prefix), module))
            continue
        before = _meta_params(module)
        allocated.append((prefix, module, _allocate_meta(module, device)))
        _keep_ties(module, before, uses or {})
        if callable(reset):
            with torch.no_grad():
                reset()
    tied_later = {(id(use.module), use.name) for places in (uses or {}).values() for use in places[1:]}
    _run_initializers([m for _, m in modules], {id(m) for _, m, _ in allocated}, initializers, order, tied_later)
    for prefix, module, fresh in allocated:
        tensors = {**module._parameters, **module._buffers}
        stuck.extend(f"{_dotted(prefix)}{name}" for name, made in fresh.items() if _unwritten(tensors[name], *made))
        for name in fresh:
            _clear_unwritten_bools(tensors[name])
    _raise_if_stuck(stuck)


def _clear_unwritten_bools(tensor: torch.Tensor) -> None:
    """A bool tensor written in part keeps ``UNWRITTEN_BYTE`` elsewhere, which no bool may hold (``~mask``
    misreads it): those elements become False, as a zero-filled allocation left them."""
    if tensor.dtype == torch.bool and tensor.numel():
        with torch.no_grad():
            data = tensor.detach().reshape(-1).view(torch.uint8)
            data.masked_fill_(data == UNWRITTEN_BYTE, 0)


def _unwritten(tensor: torch.Tensor, fresh: torch.Tensor, version: int) -> bool:
    """Whether nothing initialized an allocated tensor: a floating or complex one is still NaN
    somewhere; any other is still the allocated object with its version and every byte as allocated
    (a value test alone would take a zero-filled bool mask or an integer permutation for unwritten; the
    version alone misses writes through ``.data``, which keeps no version)."""
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    if tensor is not fresh or tensor._version != version or not tensor.numel():  # empty: nothing to write
        return False
    return bool((tensor.detach().reshape(-1).contiguous().view(torch.uint8) == UNWRITTEN_BYTE).all())


def _run_initializers(
    members: list[nn.Module],
    materialized: set[int],
    initializers: dict[int, Callable[[nn.Module], None]],
    order: list[nn.Module] | None,
    tied_later: set[tuple[int, str]],
) -> None:
    """Call each member's ``_init_weights`` where its subtree holds a materialized module, children
    first; a parameter at a later place of a tie (``tied_later``: (module id, name)) keeps its value."""
    in_unit = {id(m) for m in members}
    order = [m for m in (order or members) if id(m) in in_unit]
    touched = set(materialized)
    for module in order:  # children come first: a parent is touched if any child is
        if any(id(child) in touched for child in module.children()):
            touched.add(id(module))
    with torch.no_grad():
        for module in order:
            initializer = initializers.get(id(module))
            if initializer is None or id(module) not in touched or "reset_parameters" in module.__dict__:
                continue  # a reset_parameters assigned to the instance is the user's own init: it stays
            kept = {
                name: p.detach().clone() for name, p in module._parameters.items() if (id(module), name) in tied_later
            }
            initializer(module)
            for name, value in kept.items():
                module._parameters[name].copy_(value)


def _dotted(prefix: str) -> str:
    return f"{prefix}." if prefix else ""


def _meta_params(module: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in module._parameters.items() if p is not None and p.is_meta}


def _raise_if_stuck(stuck: list[str]) -> None:
    if stuck:
        raise ValueError(
            f"cannot initialize {stuck} from the meta device: their modules have no reset_parameters(), no enclosing "
            "_init_weights() covers them, or it left them uninitialized. Pass param_init_fn (called on each module "
            "with meta tensors; it allocates them, e.g. module.to_empty(device=..., recurse=False), and initializes "
            "them), give the module a reset_parameters(), or create these tensors on a real device"
        )
