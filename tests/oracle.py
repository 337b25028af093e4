"""Train a sharded model and its oracle side by side, in the same rank process.

The oracle is the unsharded model (a deep copy taken before sharding) with DDP semantics and
``find_unused_parameters=True``: it runs every rank's batch in turn, accumulating gradients,
divides them by the world size and steps; a parameter no rank used keeps ``grad = None``.
Both sides see the same data; the sharded side only its own rank's batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_strategy.checkpoint import full_state_dict
from fsdp_strategy.engine import shard_model

LossFn = Callable[[nn.Module, Any, int, int], torch.Tensor]  # (model, batch, rank, step) -> loss


def world_mean(value: float) -> float:
    """The mean of ``value`` over the ranks."""
    total = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def weight_error(model: nn.Module, reference: nn.Module) -> float:
    """Largest |sharded - reference| over every gathered parameter and buffer, relative to 1 + |ref|."""
    gathered = full_state_dict(model, rank0_only=False)
    expected = reference.state_dict()
    assert set(gathered) == set(expected), sorted(set(gathered) ^ set(expected))
    return max(
        ((gathered[name].float().cpu() - value.float().cpu()).abs() / (1 + value.float().cpu().abs())).max().item()
        for name, value in expected.items()
    )


def _to(batch: Any, device: str | torch.device) -> Any:
    """``batch`` (a tensor, or lists and tuples of them) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(item, device) for item in batch)
    return batch


def reference_step(reference: nn.Module, loss_fn: LossFn, batches: list, world: int, step: int) -> list[float]:
    """One DDP-semantics step of the oracle's gradients: every rank's batch, summed, divided."""
    losses = []
    for rank in range(world):
        loss = loss_fn(reference, batches[rank], rank, step)
        if loss.requires_grad:  # else the loss function ran its own backward passes
            loss.backward()
        losses.append(loss.item())
    for param in reference.parameters():
        if param.grad is not None:
            param.grad /= world
    return losses


def train_pair(
    rank: int,
    world: int,
    build: Callable[[], nn.Module],
    loss_fn: LossFn,
    data: Callable[[int, int], list],
    steps: int = 4,
    before_step: Callable[[nn.Module, int], None] | None = None,
    lr: float = 1e-2,
    shard_kwargs_for: Callable[[nn.Module], dict] | None = None,
    device: str | torch.device = "cpu",
    **shard_kwargs: Any,
) -> dict:
    """Train sharded (with ``shard_kwargs``) and oracle for ``steps``; return losses and weight error.

    ``data(step, world)`` gives the list of every rank's batch for a step (identical on all ranks);
    ``before_step(model, step)`` changes both models alike (freezing, say); ``shard_kwargs_for(model)``
    adds arguments that name the built model's own modules (``ignored_modules``). ``device``: where
    both models and the data go (tests/gpu runs them on CUDA).
    """
    torch.manual_seed(0)
    model = build().to(device)
    reference = copy.deepcopy(model)
    shard_model(model, device=device, **shard_kwargs, **(shard_kwargs_for(model) if shard_kwargs_for else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=lr)
    losses, ref_losses = [], []
    for step in range(steps):
        if before_step is not None:
            before_step(model, step)
            before_step(reference, step)
        batches = _to(data(step, world), device)
        loss = loss_fn(model, batches[rank], rank, step)
        if loss.requires_grad:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(reference_step(reference, loss_fn, batches, world, step)[rank])
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "ref_losses": ref_losses, "weight_error": weight_error(model, reference)}


def assert_matches(result: dict, what: str, rel: float = 1e-5) -> None:
    """Losses equal the oracle's at every step, weights at the end (fp32: 1e-5 relative)."""
    for step, (loss, ref) in enumerate(zip(result["losses"], result["ref_losses"])):
        assert abs(loss - ref) <= rel * abs(ref), f"{what}: step {step} loss {loss} vs oracle {ref}"
    assert result["weight_error"] < rel, f"{what}: final weights differ by {result['weight_error']:.2e}"
