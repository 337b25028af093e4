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
pattern, torch's ``MemTracker``) expects the final gradient of the parameter the optimizer steps:
the shard's, after the reduction. The engine calls a shard's hooks right after its reduced gradient
is added into ``sharded.grad`` (``run_post_accumulate_hooks``), as FSDP2 calls them in
``foreach_reduce``; an offloaded gradient's copy to host memory is waited for first. The original
parameter's are registered on the shard when the model is sharded (their handles then remove them
from the original only). Costs: per parameter and gather, two attribute reads; per reduced
parameter, one more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fsdp_strategy.engine.device import DeviceLayer

OWN = "_fsdp_custom_own_hook"  # marks the engine's own post-accumulate-grad hooks


def own_hook(hook: Callable) -> Callable:
    """Mark ``hook`` as the engine's (``run_post_accumulate_hooks`` runs only the others)."""
    setattr(hook, OWN, True)
    return hook


def register_post_accumulate(tensor: torch.Tensor, hook: Callable) -> None:
    """Register a post-accumulate-grad hook on a leaf parameter, frozen or not (kept when it is
    unfrozen later): torch registers them only while ``requires_grad`` is set."""
    trainable = tensor.requires_grad
    tensor.requires_grad_(True).register_post_accumulate_grad_hook(hook)
    tensor.requires_grad_(trainable)


def move_grad_hooks(original: torch.Tensor, sharded: torch.Tensor, unsharded: torch.Tensor) -> None:
    """When a model is sharded: the original parameter's gradient hooks become the shard's and the
    full parameter's, its post-accumulate-grad hooks the shard's ([Note: gradient hooks on parameters])."""
    for hook in list((getattr(original, "_post_accumulate_grad_hooks", None) or {}).values()):
        register_post_accumulate(sharded, hook)
    hooks = original._backward_hooks
    if hooks:
        sharded._backward_hooks = hooks
        unsharded._backward_hooks = hooks


def share_grad_hooks(params: Iterable[Any]) -> None:
    """Before a unit's full parameters are used (each gather, and a gathered unit's next use):
    every shard's gradient hooks are its full parameter's too ([Note: gradient hooks on
    parameters]). Costs: per parameter and gather, two attribute reads."""
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


def run_post_accumulate_hooks(shard: torch.Tensor, device_layer: DeviceLayer) -> None:
    """After a reduced gradient was added into ``shard.grad``: the user's post-accumulate-grad hooks
    of ``shard``, in registration order ([Note: gradient hooks on parameters])."""
    hooks = getattr(shard, "_post_accumulate_grad_hooks", None)
    if not hooks or (len(hooks) == 1 and getattr(next(iter(hooks.values())), OWN, False)):
        return
    device_layer.before_host_reads_grads()  # an offloaded gradient's copy has landed
    for hook in [hook for hook in hooks.values() if not getattr(hook, OWN, False)]:
        hook(shard)
