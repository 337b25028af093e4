"""Wrap policies: which modules become FSDP units, and which get activation checkpointing.

A policy is one of
- a set (or list/tuple) of module classes, or of their dotted import paths (as YAML gives
  them, e.g. ``["mypackage.model.Block"]``; one path alone as a string also works): every
  instance becomes a unit;
- an int: a module becomes a unit once the parameters not already in a unit below it reach
  that many elements (torch's ``size_based_auto_wrap_policy`` rule);
- a callable ``(module, recurse, nonwrapped_numel) -> bool`` as torch's policies
  (``recurse=True`` asks whether to look inside, ``recurse=False`` whether to wrap);
- torch's ``ModuleWrapPolicy`` (its class set is used).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

PolicyFn = Callable[[nn.Module, bool, int], bool]

_ACCEPTED = (
    "a set of nn.Module classes or of their dotted import paths (e.g. {'mypackage.model.Block'}; one path "
    "alone as a string works too), an int (minimum parameter count), a callable (module, recurse, "
    "nonwrapped_numel) -> bool, torch's ModuleWrapPolicy, or None"
)


class ModuleNames(frozenset):
    """An activation checkpointing policy naming modules by their qualified names in the module it
    is applied to (``ModuleNames(["model.blocks.0", "model.blocks.1"])``): what a memory plan
    chooses per unit (``auto_wrap_policy="auto"``). A name the model lacks is an error."""

    def __new__(cls, names: Any = ()) -> ModuleNames:
        names = [names] if isinstance(names, str) else list(names)
        if not all(isinstance(name, str) for name in names):
            raise TypeError(f"ModuleNames takes qualified module names (strings), got {names!r}")
        self = super().__new__(cls, names)
        self.order = tuple(dict.fromkeys(names))  # as given (model order, from a plan): how it prints
        return self

    def __repr__(self) -> str:
        """Python that makes it again, in the order given, a run of numbered names as one range:
        ``ModuleNames([f"model.layers.{i}" for i in range(20)])``."""
        names = list(getattr(self, "order", sorted(self)))
        prefixes = {name.rpartition(".")[0] for name in names}
        numbers = [name.rpartition(".")[2] for name in names]
        if len(names) > 2 and len(prefixes) == 1 and all(n.isdigit() for n in numbers):
            first, prefix = int(numbers[0]), prefixes.pop()
            if [int(n) for n in numbers] == list(range(first, first + len(names))):
                span = f"range({len(names)})" if first == 0 else f"range({first}, {first + len(names)})"
                return f'ModuleNames([f"{prefix}.{{i}}" for i in {span}])'
        return f"ModuleNames({names!r})"

    def policy_for(self, root: nn.Module) -> PolicyFn:
        """The policy function selecting these modules of ``root``."""
        found = {name: module for name, module in root.named_modules() if name in self}
        missing = sorted(self - found.keys())
        if missing:
            raise ValueError(f"activation_checkpointing_policy names modules {missing} that the model does not have")
        ids = {id(module) for module in found.values()}
        return lambda module, recurse, nonwrapped_numel: True if recurse else id(module) in ids


def _class_policy(
    classes: tuple[type[nn.Module], ...], module: nn.Module, recurse: bool, nonwrapped_numel: int
) -> bool:
    return True if recurse else isinstance(module, classes)


def _size_policy(min_num_params: int, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    if recurse:
        return True
    return nonwrapped_numel >= min_num_params and not isinstance(module, (nn.ModuleList, nn.ModuleDict))


def as_policy_fn(policy: Any, argument: str = "auto_wrap_policy") -> PolicyFn | None:
    """Validate a user policy and return it as a callable, or None for "no units below the root"."""
    if policy is None:
        return None
    if isinstance(policy, ModuleNames):
        raise TypeError(f"{argument}: ModuleNames selects modules for activation_checkpointing_policy only")
    module_classes = getattr(policy, "_module_classes", None)
    if module_classes is not None:
        policy = set(module_classes)
    if isinstance(policy, str):
        policy = [policy]
    if isinstance(policy, bool):
        raise TypeError(f"{argument}={policy!r} is not supported; accepted: {_ACCEPTED}")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"{argument}={policy!r}: a minimum parameter count must be >= 1")
        return functools.partial(_size_policy, policy)
    if isinstance(policy, (set, frozenset, list, tuple)):
        policy = [_import_class(item, argument) if isinstance(item, str) else item for item in policy]
        bad = [item for item in policy if not (isinstance(item, type) and issubclass(item, nn.Module))]
        if bad or not policy:
            raise TypeError(
                f"{argument}={policy!r}: {bad or 'an empty set'} are not nn.Module classes; accepted: {_ACCEPTED}"
            )
        return functools.partial(_class_policy, tuple(policy))
    if callable(policy) and not isinstance(policy, type):
        return policy
    raise TypeError(f"{argument}={policy!r} ({type(policy).__name__}) is not supported; accepted: {_ACCEPTED}")


def _import_class(path: str, argument: str) -> type:
    """``"package.module.Class"`` -> the class (how YAML configs name module classes)."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"{argument}={path!r}: a class name alone cannot be imported; give its dotted import path, "
            f"e.g. 'mypackage.model.{path}' (or the class itself)"
        )
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"{argument}={path!r}: cannot import it ({error}); give a dotted path like 'mypackage.model.Block'"
        ) from None


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def select_unit_modules(root: nn.Module, policy: PolicyFn | None) -> list[nn.Module]:
    """Return the modules that become units below ``root``, in pre-order (parents first)."""
    chosen: list[nn.Module] = []
    if policy is None:
        return chosen

    def visit(module: nn.Module) -> int:
        if not policy(module, True, _numel(module)):
            return 0
        wrapped = sum(visit(child) for child in module.children())
        if module is not root and policy(module, False, _numel(module) - wrapped):
            chosen.append(module)
            return _numel(module)
        return wrapped

    visit(root)
    order = {id(module): index for index, module in enumerate(root.modules())}
    return sorted(chosen, key=lambda module: order[id(module)])


def apply_activation_checkpointing(root: nn.Module, policy: Any) -> list[nn.Module]:
    """Recompute the forward of each selected module in backward instead of storing activations.

    The module's ``forward`` is replaced on the instance (no wrapper module), so parameter names
    do not change. Costs: one extra forward of those modules during backward.
    """
    if isinstance(policy, ModuleNames):
        policy_fn = policy.policy_for(root)
    else:
        policy_fn = as_policy_fn(policy, argument="activation_checkpointing_policy")
    modules = select_unit_modules(root, policy_fn)
    for module in modules:
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
        module.__dict__[_CHECKPOINTED] = True
    return modules


_CHECKPOINTED = "_fsdp_custom_recomputed"  # set on the modules apply_activation_checkpointing changed


def already_checkpointed(root: nn.Module) -> bool:
    """Whether ``root`` holds layers made to recompute already: torch's ``CheckpointWrapper``
    (``checkpoint_wrapper``, ``apply_activation_checkpointing``) or this module's own."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(isinstance(m, CheckpointWrapper) or m.__dict__.get(_CHECKPOINTED) for m in root.modules())
