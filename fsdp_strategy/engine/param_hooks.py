"""A user's gradient hooks on a sharded parameter: run on its full gradient, as without sharding.

[Note: gradient hooks on parameters]
A user registers ``p.register_hook(fn)`` on the parameter the module holds at that moment: the
original parameter before sharding, or the shard at rest (``model.parameters()`` between steps).
Neither is the tensor autograd computes with: gradients reach the full parameter while its unit
is gathered, so such a hook would never fire and its change of the gradient (a mask, a scale, a
clamp) would be lost without a word. The shard and the full parameter therefore share one hook
dict (``Tensor._backward_hooks``, which autograd reads at each call): a hook registered on either
runs on the full local gradient before the reduction, as DDP runs it before its all-reduce, and
the handle the user holds removes it from both. The original parameter's hooks are moved when the
model is sharded; hooks on a shard are shared whenever its unit is about to be used
(``share_grad_hooks`` in ``FSDPUnit.wait_unshard``: each forward and each backward gather), so a
hook registered during a step (in ``training_step``, or between forward and backward) takes effect
in that step's backward. A hook that reads its own parameter (``lambda g: g + 0.1 * p``) reads the
tensor it closed over: the original parameter, which no longer trains, or the shard: not the full
parameter DDP would read.

A post-accumulate-grad hook (``register_post_accumulate_grad_hook``: the optimizer-in-backward
pattern) expects the final gradient of the parameter the optimizer steps, the shard's after the
reduction; the engine does not call such hooks, so they are refused by name instead of never
firing. Costs: per parameter and iteration, two attribute reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

OWN = "_fsdp_custom_own_hook"  # marks the engine's own post-accumulate-grad hooks


def own_hook(hook: Callable) -> Callable:
    """Mark ``hook`` as the engine's (``share_grad_hooks`` refuses the others on a shard)."""
    setattr(hook, OWN, True)
    return hook


def move_grad_hooks(original: torch.Tensor, sharded: torch.Tensor, unsharded: torch.Tensor, fqn: str) -> None:
    """When a model is sharded: the original parameter's gradient hooks become the shard's and the
    full parameter's ([Note: gradient hooks on parameters]); its post-accumulate-grad hooks are refused."""
    _refuse_post_accumulate(original, fqn, "before the model was sharded")
    hooks = original._backward_hooks
    if hooks:
        sharded._backward_hooks = hooks
        unsharded._backward_hooks = hooks


def refuse_post_accumulate_hooks(params: Iterable[Any]) -> None:
    """At the start of an iteration: a user's post-accumulate-grad hook on a shard is refused
    ([Note: gradient hooks on parameters])."""
    for param in params:
        _refuse_post_accumulate(param.sharded, param.fqn, "on its shard")


def share_grad_hooks(params: Iterable[Any]) -> None:
    """Before a unit's full parameters are used (each gather, and a gathered unit's next use):
    every shard's gradient hooks are its full parameter's too ([Note: gradient hooks on
    parameters]). Costs: per parameter, two attribute reads."""
    for param in params:
        sharded, unsharded = param.sharded, param.unsharded
        hooks = sharded._backward_hooks
        if not hooks or hooks is unsharded._backward_hooks:
            continue
        if unsharded._backward_hooks:
            raise RuntimeError(
                f"fsdp_custom: parameter {param.fqn!r} has gradient hooks registered on its shard (between steps) "
                "and others on its full parameter (while gathered, during a step): register them in one place, "
                "before training, e.g. on model.parameters() after the model is set up"
            )
        unsharded._backward_hooks = hooks


def _refuse_post_accumulate(tensor: torch.Tensor, fqn: str, where: str) -> None:
    hooks = getattr(tensor, "_post_accumulate_grad_hooks", None) or {}
    if any(not getattr(hook, OWN, False) for hook in hooks.values()):
        raise RuntimeError(
            f"fsdp_custom: parameter {fqn!r} has a post-accumulate-grad hook registered {where} "
            "(register_post_accumulate_grad_hook, e.g. an optimizer stepped inside backward). The engine does "
            "not call such hooks on sharded parameters, so it would never run. Step the optimizer after "
            "backward (the Trainer does), or remove the hook"
        )
