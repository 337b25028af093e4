"""Scheduler: decides *when* units gather, reshard and reduce; owns every hook of the engine.

One training step (see design.md): the root's forward pre-hook starts the iteration; each
unit's pre-hook gathers it and prefetches the next unit in the recorded forward order; its
post-hook frees it (FULL_SHARD, non-root) and hooks its outputs for backward; the backward
pre-hook gathers it again and prefetches the unit backward reaches next; post-accumulate-grad
hooks start ONE reduce-scatter per unit once all its gradients exist; a callback queued at
the end of backward finishes every reduction and reshards what is left.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from fsdp_strategy.config import MixedPrecision, ShardingStrategy
from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.accounting import MemoryAccount
from fsdp_strategy.engine.collectives import CommLedger
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.unit import FSDPUnit, PendingReduce

# [Note: reshard after backward]
# Once every trainable parameter of a unit has its gradient, every op that uses a trainable
# parameter of the unit has run its backward, so its full parameters can be freed at once.
# Ops that use only frozen parameters may still be ahead, so a unit that holds frozen
# parameters keeps its full parameters until the end-of-backward callback.

# [Note: bounded prefetch]
# At most one unit is prefetched ahead of the one running, and at most one reduce-scatter is
# in flight beyond the one just issued: besides the running unit, at most two units hold
# full parameters (the root, which stays gathered from forward to backward, and the prefetched
# one), so memory stays bounded by the largest units, not the model.


class TrainingState(Enum):
    """What the scheduler is in the middle of."""

    IDLE = auto()  # between iterations: every unit is sharded
    FORWARD = auto()  # inside the root module's forward
    BACKWARD = auto()  # autograd is running; forward hooks (activation recomputation) are ignored


class Scheduler:
    """Registers the engine's hooks on the root and its units and runs the step's schedule.

    Costs: a few Python hooks per unit per step; the execution order is recorded once, on the
    first forward with gradients enabled, and used for prefetching from the second step on.
    """

    def __init__(
        self,
        units: list[FSDPUnit],
        sharding_strategy: ShardingStrategy,
        mixed_precision: MixedPrecision,
        ledger: CommLedger,
        memory: MemoryAccount,
        device: torch.device,
        device_mesh: Any = None,
    ) -> None:
        self.device_mesh = device_mesh  # the HSDP (replicate, shard) mesh, if any
        self.units = units
        self.root_unit = units[0]
        self.sharding_strategy = sharding_strategy
        self.mixed_precision = mixed_precision
        self.ledger = ledger
        self.memory = memory
        self.device = device
        self.state = TrainingState.IDLE
        self.forward_order: list[FSDPUnit] = []
        self._order_index: dict[int, int] = {}  # unit id -> position; empty until the order is recorded
        self._recording = False
        self._sync_grads = True
        self._callback_queued = False
        self._pending_reduces: deque[PendingReduce] = deque()
        self._register_hooks()

    # ---- hooks -------------------------------------------------------------------------

    def _register_hooks(self) -> None:
        for unit in self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit), with_kwargs=True)
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
            for param in unit.trainable:
                param.unsharded.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, unit, param))

    def _pre_forward(self, unit: FSDPUnit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.state is TrainingState.BACKWARD:
            return args, kwargs
        if unit is self.root_unit:
            args, kwargs = self._start_iteration(args, kwargs)
        if self._recording:
            self.forward_order.append(unit)
        unit.wait_unshard()
        if torch.is_grad_enabled():
            self._prefetch(unit, step=1)
        return args, kwargs

    def _post_forward(self, unit: FSDPUnit, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.state is TrainingState.BACKWARD:
            return output
        if not torch.is_grad_enabled():
            if unit is self.root_unit:
                self._reshard_all()
                self.state = TrainingState.IDLE
            else:
                unit.reshard()
            return output
        if unit is self.root_unit:
            if self._recording:
                self._order_index = {id(u): i for i, u in enumerate(self.forward_order)}
                self._recording = False
        elif self.sharding_strategy.reshard_after_forward:
            unit.reshard()
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(functools.partial(self._pre_backward, unit))
        return output

    def _pre_backward(self, unit: FSDPUnit, grad: torch.Tensor) -> None:
        self._enter_backward()
        unit.wait_unshard()
        self._prefetch(unit, step=-1)

    def _on_grad_ready(self, unit: FSDPUnit, param: ShardedParam, tensor: torch.Tensor) -> None:
        self._enter_backward()
        if not self._sync_grads or not unit.mark_grad_ready(param):
            return
        self._issue_reduce(unit)
        if not unit.has_frozen:  # [Note: reshard after backward]
            unit.reshard()

    def _end_of_backward(self) -> None:
        if self._sync_grads:
            for unit in self.units:
                if unit.has_unreduced_grads:
                    self._issue_reduce(unit)
        while self._pending_reduces:
            self._pending_reduces.popleft().finish()
        for unit in self.units:
            unit.clear_grad_marks()
        self._reshard_all()
        self._callback_queued = False
        self.state = TrainingState.IDLE

    # ---- schedule ----------------------------------------------------------------------

    def _start_iteration(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.state is not TrainingState.IDLE:
            self._reshard_all()  # a forward whose backward never ran
        self.state = TrainingState.FORWARD
        self._recording = not self._order_index and torch.is_grad_enabled()
        dtype = self.mixed_precision.param_dtype
        if dtype is not None:

            def cast(value: Any) -> Any:
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    return value.to(dtype)
                return value

            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def _prefetch(self, unit: FSDPUnit, step: int) -> None:
        """Start gathering the unit after ``unit`` (step=1) or before it (step=-1) in forward order."""
        position = self._order_index.get(id(unit))
        if position is None:
            return
        index = position + step
        if 0 <= index < len(self.forward_order):
            self.forward_order[index].unshard()  # [Note: bounded prefetch]

    def _issue_reduce(self, unit: FSDPUnit) -> None:
        pending = unit.reduce_grads()
        while len(self._pending_reduces) >= 1:  # [Note: bounded prefetch]
            self._pending_reduces.popleft().finish()
        if pending is not None:
            self._pending_reduces.append(pending)

    def _enter_backward(self) -> None:
        self.state = TrainingState.BACKWARD
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _reshard_all(self) -> None:
        for unit in self.units:
            unit.reshard()

    # ---- public ------------------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction: full gradients accumulate locally until a backward outside.

        Costs: every trainable parameter keeps a full-size gradient in ``param_dtype`` between
        micro-batches (see :meth:`unsharded_grad_bytes`), in exchange for no reduce-scatter.
        """
        previous, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = previous

    def unsharded_grad_bytes(self) -> int:
        """Bytes of full-size gradients held now (non-zero only inside ``no_sync`` accumulation)."""
        return sum(
            p.unsharded.grad.numel() * p.unsharded.grad.element_size()
            for unit in self.units
            for p in unit.trainable
            if p.unsharded.grad is not None
        )

    def sharded_bytes(self) -> dict[str, int]:
        """This rank's bytes at rest: ``{"params": ..., "grads": ...}`` of the shards."""
        params = [p.sharded for p in self.sharded_params()]
        return {
            "params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        }

    def sharded_params(self) -> list[ShardedParam]:
        """Every ShardedParam of the model, unit by unit."""
        return [p for unit in self.units for p in unit.params]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the sharded gradients by their global norm over all ranks (one all-reduce).

        Replicas (NO_SHARD, HYBRID_SHARD) hold the same shard, so the norm is reduced over the
        shard group only. Returns the total norm before clipping, as ``clip_grad_norm_`` does.
        """
        grads = [p.sharded.grad.detach() for p in self.sharded_params() if p.sharded.grad is not None]
        norm_type = float(norm_type)
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads])
            local = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
        else:
            local = torch.zeros((), dtype=torch.float32)
        total = local.to(self.device, copy=True)
        op = "max" if math.isinf(norm_type) else "sum"
        collectives.all_reduce(total, self.root_unit.shard_comm, self.ledger, "clip_grad_norm", op=op).wait()
        if not math.isinf(norm_type):
            total = total.pow(1.0 / norm_type)
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(clip_coef.to(grad.device, grad.dtype))
        return total
