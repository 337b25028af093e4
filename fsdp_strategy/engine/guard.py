"""Guards: a module that computes with sharded parameters raises instead of using its shard.

[Note: loud misuse]
At rest every module holds its parameters' shards: plain tensors of plausible shape, so code
that calls a submodule outside the forward of the unit that gathers it (a ``generate()`` in a
callback, a direct call of a block's layer from the root) would compute with this rank's rows
silently. Every module that registers a sharded parameter gets a forward pre-hook that checks
its units are gathered and raises otherwise, naming the module and what to do. The same hook
reconciles ``requires_grad`` of shards and full parameters (a unit gathered for a whole step,
like the root, follows freezing and ``toggle_optimizer`` within the step). Under ``torch.compile`` the check
is skipped (it compiles to nothing, so it breaks no graph). Costs: one Python call per call of
such a module.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.param_hooks import own_hook
from fsdp_strategy.engine.unit import FSDPUnit, ShardedState


def _check_gathered(
    name: str, holders: list[tuple[FSDPUnit, list[ShardedParam]]], module: nn.Module, args: tuple
) -> None:
    if torch.compiler.is_compiling():
        return
    for unit, params in holders:
        if unit.state is not ShardedState.UNSHARDED:
            raise RuntimeError(
                f"fsdp_custom: module {name!r} ({type(module).__name__}) was called while its parameters are sharded "
                f"(unit {unit.name!r} is not gathered), so it would compute with this rank's shard. Call it from the "
                f"forward of the model (or of unit {unit.name!r}), or gather the model first: "
                "`with summon_full_params(model): ...`"
            )
        for param in params:
            param.sync_requires_grad()


def install_guards(root: nn.Module, units: list[FSDPUnit]) -> list[RemovableHandle]:
    """Register the [Note: loud misuse] check on every module that holds a sharded parameter;
    return the hooks' handles."""
    names = {id(module): name or "root" for name, module in root.named_modules()}
    holders: dict[int, dict[FSDPUnit, list[ShardedParam]]] = defaultdict(dict)  # module id -> unit -> params
    modules: dict[int, nn.Module] = {}
    for unit in units:
        for param in unit.params:
            for use in param.uses:
                modules[id(use.module)] = use.module
                holders[id(use.module)].setdefault(unit, []).append(param)
    handles = []
    for module_id, by_unit in holders.items():
        hook = functools.partial(_check_gathered, names[module_id], list(by_unit.items()))
        handles.append(modules[module_id].register_forward_pre_hook(hook))
    return handles


def shard_used_by(param: ShardedParam) -> Any:
    """The hook that makes a computation on a shard loud: outside its unit's forward a parameter is
    this rank's rows only, so a loss computed from it (an L2 penalty over ``self.parameters()``)
    would be silently wrong; the engine itself never differentiates through a shard."""

    @torch._dynamo.disable
    def hook(shard: torch.Tensor) -> None:
        shard.grad = None
        raise RuntimeError(
            f"fsdp_custom: parameter {param.fqn!r} was used in a computation that needs its gradient while it is "
            f"this rank's shard ({param.chunk_rows} of its {param.dim0} rows): outside the forward of its unit, a "
            "value computed from it (a norm, a penalty) covers this rank's rows only. Compute it inside the model's "
            "forward, or gather the model with summon_full_params, or keep the module in the unit whose forward "
            "runs training_step (the default wrapping)"
        )

    return own_hook(hook)
