"""Train a sharded model and its oracle side by side, in the same rank process.

The oracle is the unsharded model (a deep copy taken before sharding) with DDP semantics and
``find_unused_parameters=True``: it runs every rank's batch in turn, accumulating gradients,
divides them by the world size and steps; a parameter no rank used keeps ``grad = None``.
Both sides see the same data; the sharded side only its own rank's batch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
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
        ((_real(gathered[name]) - _real(value)).abs() / (1 + _real(value).abs())).max().item()
        for name, value in expected.items()
    )


def _real(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU in float32 for comparison; a complex one as its real and imaginary parts."""
    tensor = tensor.detach().cpu()
    return torch.view_as_real(tensor.to(torch.complex64)) if tensor.is_complex() else tensor.float()


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


_LOW = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


class PrecisionOracle:
    """DDP semantics at a Lightning precision, in one process, computed as the engine computes:
    the weights each rank computes with are the master weights cast to the low dtype
    (``*-mixed``: an fp32 master, a low copy for the forward under ``torch.autocast``; ``*-true``:
    the model itself in the low dtype); each rank's gradient comes in that dtype, micro-batches
    and ranks are summed in the reduce dtype (fp32 for ``*-mixed``, the low dtype for ``*-true``)
    and divided by the world size; a grad scaler's scale multiplies the loss and is divided out
    of the reduced gradient; clipping takes the norm as the engine does (fp32 norms of each
    gradient). A mistake in any of these (precision never applied, a reduce in the wrong dtype, a
    lost divide) moves the result by far more than the last bits this leaves."""

    def __init__(self, model: nn.Module, precision: str, make_optimizer: Callable, scale: float | None = None) -> None:
        low = _LOW[precision.split("-")[0]]
        self.mixed = precision.endswith("-mixed")
        self.low, self.reduce_dtype, self.scale = low, torch.float32 if self.mixed else low, scale
        self.master = model if self.mixed else _floating_to(model, low)
        self.compute = _floating_to(copy.deepcopy(model), low) if self.mixed else self.master
        self.optimizer = make_optimizer(self.master)
        self._sums: dict[str, torch.Tensor] = {}

    def micro_batch(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batches: list, divide: int = 1) -> list:
        """One micro-batch on every rank (``batches[r]``, the loss divided by ``divide``): the
        ranks' losses; their gradients are added into the step's sums."""
        if self.mixed and not self._sums:  # the weights the ranks gather for this step
            with torch.no_grad():
                for low, master in zip(self.compute.parameters(), self.master.parameters()):
                    low.copy_(master)
        losses = []
        for rank, batch in enumerate(batches):
            self.compute.zero_grad(set_to_none=True)
            context = torch.autocast("cpu", dtype=self.low) if self.mixed else contextlib.nullcontext()
            with context:
                loss = loss_fn(self.compute, batch) / divide
            (loss * self.scale if self.scale else loss).backward()
            for name, param in self.compute.named_parameters():
                if param.grad is None:
                    continue
                grad = param.grad.to(self.reduce_dtype) if param.grad.is_floating_point() else param.grad
                key = (rank, name)
                self._sums[key] = self._sums[key] + grad if key in self._sums else grad
            losses.append(loss.item() * divide)
        return losses

    def step(self, world: int, clip_norm: float | None = None) -> float | None:
        """Reduce the sums (ranks in order, then the divide), unscale, clip, step; the norm if clipped."""
        masters = dict(self.master.named_parameters())
        for name in {name for _, name in self._sums}:
            ranks = [self._sums[(rank, name)] for rank in range(world) if (rank, name) in self._sums]
            reduced = functools.reduce(torch.add, ranks) / world
            if self.scale:
                reduced = reduced * (1.0 / self.scale)
            masters[name].grad = reduced.to(masters[name].dtype)
        self._sums = {}
        norm = None
        if clip_norm is not None:
            params = [p for p in self.master.parameters() if p.grad is not None]
            norms = [
                torch.linalg.vector_norm(p.grad.to(torch.promote_types(p.grad.dtype, torch.float32))) for p in params
            ]
            norm = torch.nn.utils.get_total_norm(norms, 2.0)
            torch.nn.utils.clip_grads_with_norm_(params, clip_norm, norm)
            norm = norm.item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def _floating_to(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its floating parameters and buffers in ``dtype`` (complex and integer ones kept)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype)
    return model


def gathered_and_reduced_dtypes(model: nn.Module) -> dict[str, set[str]]:
    """The dtypes the engine's all-gathers and reduce-scatters (or NO_SHARD's all-reduces of
    gradients) of ``model`` carried, from its flight recorder: ``{"all_gather": {...}, ...}``."""
    from fsdp_strategy.engine import get_scheduler

    seen: dict[str, set[str]] = {}
    for record in get_scheduler(model).observer.recorder.snapshot():
        if record["dtype"]:
            seen.setdefault(record["kind"], set()).add(record["dtype"])
    return seen
