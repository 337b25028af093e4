"""FSDPUnit: the parameters that are gathered together and reduced together.

A unit does *what*: one all-gather of all its shards, the copy-out into full parameters, one
reduce-scatter of all its gradients, the swap back to shards. It registers no hooks and
decides no order; the Scheduler (runtime.py) decides *when*.
"""

from __future__ import annotations

import functools
from enum import Enum, auto
from typing import NamedTuple

import torch
from torch import nn

from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.accounting import MemoryAccount
from fsdp_strategy.engine.collectives import CommGroup, CommLedger, Pending
from fsdp_strategy.engine.param import ShardedParam


class ShardedState(Enum):
    """Where a unit's parameters are."""

    SHARDED = auto()  # only the shards exist; modules hold the sharded parameters
    GATHERING = auto()  # an all-gather is in flight; modules still hold the sharded parameters
    UNSHARDED = auto()  # full parameters are filled and registered in the modules


class UnitContext(NamedTuple):
    """What every unit of a model shares: groups, dtypes, device and the engine's accounts."""

    shard_comm: CommGroup  # the group a unit's parameters are sharded over
    replicate_comm: CommGroup  # the group its shards are replicated over (HYBRID_SHARD, NO_SHARD)
    reduce_dtype: torch.dtype | None  # gradient reduction dtype; None: the shard's dtype
    device: torch.device  # where full parameters and collectives live
    ledger: CommLedger  # counts every collective
    memory: MemoryAccount  # counts gathered parameter bytes


class PendingReduce:
    """A unit's gradient reduce-scatter in flight; ``finish()`` adds the result into the shards."""

    def __init__(self, unit: FSDPUnit, work: Pending, output: torch.Tensor, present: list[bool]) -> None:
        self.unit = unit
        self.work = work
        self.output = output
        self.present = present

    def finish(self) -> None:
        """Wait for the reduce-scatter and add its result into the unit's sharded gradients."""
        self.work.wait()
        self.unit.apply_reduced_grads(self.output, self.present)


class FSDPUnit:
    """One unit: its ShardedParams, their flat layout, and gather / reduce / reshard.

    Costs: while gathered, the full parameters in ``param_dtype``; during a gather, also the
    flat gather buffer (as large again) until the copy-out ends; during a reduction, a flat
    gradient buffer of the unit's trainable full size in ``reduce_dtype``.
    """

    def __init__(self, name: str, module: nn.Module, params: list[ShardedParam], context: UnitContext) -> None:
        self.name = name
        self.module = module
        self.params = params
        self.trainable = [p for p in params if p.requires_grad]
        self.has_frozen = len(self.trainable) != len(params)
        self.shard_comm = context.shard_comm
        self.replicate_comm = context.replicate_comm
        self.device = context.device
        self.ledger = context.ledger
        self.memory = context.memory
        self.state = ShardedState.SHARDED
        self._aliased = bool(params) and all(p.aliased for p in params)  # [Note: aliased shards]
        self._shard_sizes = [p.shard_numel for p in params]
        self.unsharded_nbytes = sum(p.unsharded_nbytes for p in params)  # what gathering the unit adds
        self._gather: tuple[Pending, torch.Tensor] | None = None
        self._grads_ready: set[int] = set()
        self._param_dtype = params[0].param_dtype if params else torch.float32
        self._reduce_dtype = context.reduce_dtype or (params[0].sharded.dtype if params else torch.float32)
        dtypes = {p.param_dtype for p in params}
        if len(dtypes) > 1:
            names = {p.fqn: str(p.param_dtype) for p in params}
            raise ValueError(
                f"unit {name!r} mixes parameter dtypes {names}; a unit gathers one flat buffer of one dtype. "
                "Cast the module to one dtype, or wrap the differing parameters in their own unit"
            )

    def _start_gather(self, shards: list[torch.Tensor], dtype: torch.dtype) -> tuple[Pending, torch.Tensor]:
        """Copy one shard-shaped tensor per parameter into a flat buffer (in ``dtype``, on the
        compute device) and start ONE all-gather of it; return the work and the gather buffer."""
        flat_shard = torch.empty(sum(self._shard_sizes), dtype=dtype, device=self.device)
        torch._foreach_copy_(list(flat_shard.split(self._shard_sizes)), [s.detach().reshape(-1) for s in shards])
        gathered = flat_shard.new_empty(flat_shard.numel() * self.shard_comm.size)
        return collectives.all_gather(gathered, flat_shard, self.shard_comm, self.ledger, self.name), gathered

    def _rows(self, gathered: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each parameter's ``(N, shard_numel)`` slice of a gather buffer."""
        return gathered.view(self.shard_comm.size, -1).split(self._shard_sizes, dim=1)

    def unshard(self) -> None:
        """Start the all-gather of the unit's shards (no-op unless the unit is sharded)."""
        if self.state is not ShardedState.SHARDED or not self.params or self._aliased:
            return
        self._gather = self._start_gather([p.sharded for p in self.params], self._param_dtype)
        self.state = ShardedState.GATHERING

    def gather_full(self, shards: list[torch.Tensor], keep: bool = True) -> list[torch.Tensor]:
        """All-gather one shard-shaped tensor per parameter (in its own dtype) into full tensors.

        Used for checkpoints: the fp32 master weights and optimizer state, not ``param_dtype``.
        With ``keep=False`` this rank only contributes its shards and gets ``[]``.
        Costs: the unit's full size in that dtype, on the compute device, until returned.
        """
        if not self.params:
            return []
        dtype = functools.reduce(torch.promote_types, (s.dtype for s in shards))
        work, gathered = self._start_gather(shards, dtype)
        work.wait()
        if not keep:
            return []
        return [param.full_from_rows(param_rows) for param, param_rows in zip(self.params, self._rows(gathered))]

    def wait_unshard(self) -> None:
        """Make the full parameters usable: start the gather if needed, wait, copy out, register."""
        self.unshard()
        if self._aliased and self.state is ShardedState.SHARDED:
            for param in self.params:
                param.install(unsharded=True)
            self.memory.allocated(self.name, 0)
            self.state = ShardedState.UNSHARDED
            return
        if self.state is not ShardedState.GATHERING:
            return
        work, gathered = self._gather
        self._gather = None
        work.wait()
        with torch.no_grad():
            for param, param_rows in zip(self.params, self._rows(gathered)):
                param.fill_unsharded(param_rows)
                param.install(unsharded=True)
        self.memory.allocated(self.name, self.unsharded_nbytes)
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Register the shards again and free the full parameters (and any gather in flight)."""
        if self._gather is not None:
            self._gather[0].wait()
            self._gather = None
        if self.state is ShardedState.UNSHARDED:
            for param in self.params:
                param.install(unsharded=False)
                param.free_unsharded()
            self.memory.freed(self.name, self.unsharded_nbytes)
        self.state = ShardedState.SHARDED

    def mark_grad_ready(self, param: ShardedParam) -> bool:
        """Note that ``param`` has its gradient; True once every trainable parameter has one."""
        self._grads_ready.add(id(param))
        return len(self._grads_ready) == len(self.trainable)

    @property
    def has_unreduced_grads(self) -> bool:
        """Whether some full gradient of this unit waits to be reduced."""
        return any(p.unsharded.grad is not None for p in self.trainable)

    def reduce_grads(self) -> PendingReduce | None:
        """Flatten the full gradients (zeros for missing ones), start ONE reduce-scatter, free them.

        [Note: missing gradients] A parameter without a gradient on this rank is reduced as
        zeros and keeps ``sharded.grad`` as it was (None after ``zero_grad``), so optimizers
        skip it as they would unsharded. As with DDP, every rank is assumed to give gradients
        to the same parameters.
        """
        self._grads_ready.clear()
        if not self.has_unreduced_grads:
            return None
        sizes = [p.shard_numel for p in self.trainable]
        world = self.shard_comm.size
        flat = torch.empty(world, sum(sizes), dtype=self._reduce_dtype, device=self.device)
        present = []
        for param, columns in zip(self.trainable, flat.split(sizes, dim=1)):
            grad = param.unsharded.grad
            present.append(grad is not None)
            if grad is None:
                columns.zero_()
            else:
                columns.copy_(param.padded_grad_rows(grad))
            param.unsharded.grad = None
        output = torch.empty(sum(sizes), dtype=self._reduce_dtype, device=self.device)
        work = collectives.reduce_scatter(output, flat.view(-1), self.shard_comm, self.ledger, self.name)
        return PendingReduce(self, work, output, present)

    def apply_reduced_grads(self, output: torch.Tensor, present: list[bool]) -> None:
        """Reduce across replicas if any, divide by the data-parallel size, add into the shards."""
        collectives.all_reduce(output, self.replicate_comm, self.ledger, self.name).wait()
        output.div_(self.shard_comm.size * self.replicate_comm.size)  # [Note: SUM then divide]
        pieces = output.split([p.shard_numel for p in self.trainable])
        for param, piece, has_grad in zip(self.trainable, pieces, present):
            if has_grad:  # [Note: missing gradients]
                param.accumulate_sharded_grad(piece)

    def clear_grad_marks(self) -> None:
        """Forget which gradients arrived (at the end of every backward)."""
        self._grads_ready.clear()
