"""Which unit owns each parameter and each module, from every place they are registered.

[Note: lowest common unit]
A module can be registered at several places (a submodule object shared by two blocks, a
recurrent block listed three times) and a parameter can belong to several modules (an
embedding tied to the LM head). For one registration path, the chain of units along it is the
units whose paths are prefixes of it, outermost (the root) first. A parameter belongs to the
deepest unit common to the chains of every path of every module that registers it; a module
to the deepest unit common to the chains of its own paths. Every place the object is used
then runs inside the forward of the unit that gathers it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from torch import nn

from fsdp_strategy.engine.param import ParamUse

Path = tuple[str, ...]


class Placement(NamedTuple):
    """The outcome of planning: owners of parameters and modules, by unit index."""

    unit_names: list[str]  # index -> the unit module's first registration path ("root" for the root)
    params: dict[int, list[int]]  # unit index -> ids of the parameters it owns, in registration order
    modules: dict[int, list[tuple[str, nn.Module]]]  # unit index -> (name, module) of the modules it owns
    uses: dict[int, list[ParamUse]]  # parameter id -> every place it is registered
    param_names: dict[int, str]  # parameter id -> its first qualified name


def _paths(root: nn.Module) -> dict[int, list[Path]]:
    paths: dict[int, list[Path]] = defaultdict(list)
    for name, module in root.named_modules(remove_duplicate=False):
        paths[id(module)].append(tuple(name.split(".")) if name else ())
    return paths


def _chain(path: Path, unit_at: dict[Path, int]) -> list[int]:
    return [unit_at[path[:length]] for length in range(len(path) + 1) if path[:length] in unit_at]


def _common_unit(chains: list[list[int]]) -> int:
    common = 0
    for depth, units in enumerate(zip(*chains)):
        if len(set(units)) != 1:
            break
        common = depth
    return chains[0][common]


def plan_units(root: nn.Module, unit_modules: list[nn.Module], skip: frozenset[int] = frozenset()) -> Placement:
    """Assign parameters and modules to units ([Note: lowest common unit]); ``unit_modules[0]`` is the root.

    ``skip``: ids of modules the engine leaves alone ([Note: ignored modules] in ignored.py).
    """
    paths = _paths(root)
    unit_at: dict[Path, int] = {}
    for index, module in enumerate(unit_modules):
        for path in paths[id(module)]:
            unit_at.setdefault(path, index)
    names = ["root"] + [".".join(paths[id(m)][0]) for m in unit_modules[1:]]

    uses: dict[int, list[ParamUse]] = defaultdict(list)
    param_names: dict[int, str] = {}
    param_chains: dict[int, list[list[int]]] = defaultdict(list)
    seen: set[tuple[int, str]] = set()
    module_owner: dict[int, int] = {}
    modules: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
    for name, module in root.named_modules():  # each module once, at its first path
        if id(module) in skip:
            continue
        chains = [_chain(path, unit_at) for path in paths[id(module)]]
        owner = _common_unit(chains)
        module_owner[id(module)] = owner
        modules[owner].append((name, module))
        for param_name, param in module._parameters.items():
            if param is None or (id(module), param_name) in seen:
                continue
            seen.add((id(module), param_name))
            uses[id(param)].append(ParamUse(module, param_name))
            param_names.setdefault(id(param), f"{name}.{param_name}" if name else param_name)
            param_chains[id(param)].extend(chains)
    params: dict[int, list[int]] = defaultdict(list)
    for param_id in uses:
        params[_common_unit(param_chains[param_id])].append(param_id)
    return Placement(names, params, modules, uses, param_names)
