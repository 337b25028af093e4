"""A unit's bytes in a gather and in a reduction: the flat buffers, their copies, the collectives.

The shape is FSDP2's ``_fsdp_collectives``. Gather: ``start_gather`` (copy-in and the collective)
returns a ``GatherResult``; ``GatherResult.wait()`` is the one place a stream waits for the gather
(on NCCL a CUDA stream, on gloo the host); ``copy_out`` fills the full parameters from it. The
unit's forward gather, its ``refresh`` after an optimizer step and ``gather_full`` (checkpoints)
call the same two functions. Reduction: ``start_reduce`` copies the full gradients into one flat
buffer with their usage flags and issues one reduce-scatter (NO_SHARD: one all-reduce) returning
a ``PendingReduce``, whose ``start_replicate`` / ``finish`` carry it to the shards' gradients
(reductions.py decides their turn). A unit decides *when*; here is *what* the bytes do, with the
copies counted in the ledger through the ``CommContext`` and the buffers in the memory account.

[Note: usage flags]
Every reduction carries, after the gradient columns of each rank's row, one flag per
parameter: 1 where this rank has a gradient for it, 0 where it has none (its columns are
zeros). Reduced with SUM, each rank's shard ends with the number of ranks that had a gradient.
A parameter no rank had a gradient for keeps ``sharded.grad`` as it was (None after
``zero_grad``), so optimizers skip it; one that some rank had a gradient for gets the average
over all ranks, zeros included: DDP with ``find_unused_parameters=True``. The flags cost K
elements per rank and no extra collective; reading a global flag back (a device sync on CUDA)
is only needed for parameters this rank did not use, and is deferred to the end of backward.

Costs: the gather buffer, ``world x (shard elements + stamp slots)`` in the layout's dtype, from
``start_gather`` until the result is dropped; one copy of the shards in and one of the full
parameters out. A reduction: the unit's trainable full size in the reduce dtype plus one shard
of it (and the exchange's scratch on gloo), from ``start_reduce`` until ``finish``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.accounting import MemoryAccount
from fsdp_strategy.engine.collectives import CommContext, CommGroup, Pending
from fsdp_strategy.engine.device import DeviceLayer
from fsdp_strategy.engine.flat import FlatLayout, real_dtype, real_view
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.param_hooks import run_post_accumulate_hooks
from fsdp_strategy.engine.trace import span


class GatherResult:
    """An all-gather in flight and the buffer it fills: every rank's flat shard, rank-major, each
    row followed by its order stamp slots ([Note: flat buffers of any dtype] in flat.py)."""

    def __init__(self, work: Pending, gathered: torch.Tensor, layout: FlatLayout, stamp_slots: int) -> None:
        self.work = work
        self.gathered = gathered
        self.layout = layout  # where each parameter's columns are
        self.nbytes = gathered.numel() * gathered.element_size()  # [Note: what gathering allocates]
        self._stamp_slots = stamp_slots

    def wait(self) -> None:
        """Make the gathered bytes usable: the host waits on gloo, the stream on NCCL (idempotent)."""
        self.work.wait()

    def pieces(self) -> list[torch.Tensor]:
        """Per parameter, its ``(N, shard elements)`` columns of the buffer (stamps left out), in its dtype."""
        return self.layout.pieces(self.gathered[:, : self.gathered.shape[1] - self._stamp_slots])


def start_gather(
    unit: str,
    shards: list[torch.Tensor],
    dtypes: list[torch.dtype],
    comm: CommGroup,
    ctx: CommContext,
    device_layer: DeviceLayer,
    stamp_slots: int,
) -> GatherResult:
    """Copy one shard-shaped tensor per parameter (cast to its entry of ``dtypes``, on the compute
    device) into this rank's row of a new gather buffer and start ONE all-gather into it in place."""
    layout = FlatLayout.of(dtypes, [shard.numel() for shard in shards])
    device_layer.before_gather()  # [Note: host and device] 3
    gathered = torch.empty(comm.size, layout.total + stamp_slots, dtype=layout.dtype, device=device_layer.compute)
    flat_shard = gathered[comm.rank]
    with span("gather_copy_in"):
        pieces = layout.pieces(flat_shard[: layout.total])
        device_layer.copy_shards_in(pieces, [real_view(shard.detach()) for shard in shards], unit)
    ctx.record_copy("gather_copy_in", layout.total * gathered.element_size())
    work = collectives.all_gather(gathered.view(-1), flat_shard, comm, ctx, unit, stamp_slots > 0)
    return GatherResult(work, gathered, layout, stamp_slots)


def copy_out(result: GatherResult, targets: list[torch.Tensor], ctx: CommContext, nbytes: int) -> None:
    """Wait for ``result`` and fill ``targets`` (the full parameters, flat rows in the padded
    layout, ``nbytes`` in all) from it, their autograd versions kept."""
    result.wait()
    with torch.no_grad(), span("gather_copy_out"):
        reals = [t.view(real_dtype(t.dtype)) if t.is_complex() else t for t in targets]
        with torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
            if result.layout.bytes_mode:
                torch._foreach_copy_(reals, result.pieces())
            else:
                columns = result.gathered[:, : result.layout.total]
                torch.split_with_sizes_copy(columns, result.layout.sizes, dim=1, out=reals)
        ctx.record_copy("gather_copy_out", nbytes)


# ---- reduce ---------------------------------------------------------------------------


class ReduceSpec(NamedTuple):
    """What a unit's reductions need of it (not the unit: a reduction in flight outlives no unit,
    and buffers.py imports nothing of unit.py)."""

    unit: str
    shard_comm: CommGroup  # the reduce-scatter's group
    replicate_comm: CommGroup  # the all-reduce's across replicas (HYBRID_SHARD) or of NO_SHARD
    ctx: CommContext
    device_layer: DeviceLayer
    memory: MemoryAccount
    dtype: torch.dtype  # the reduce dtype
    divide_before: float  # [Note: SUM then divide] in collectives.py
    divide_after: float
    stamp_slots: int  # [Note: order stamps]


class UndecidedGrad(NamedTuple):
    """A reduced gradient for a parameter this rank did not use: applied if any rank used it."""

    param: ShardedParam
    reduced: torch.Tensor  # this rank's shard of the averaged gradient
    flag: torch.Tensor  # 0-dim: how many ranks had a gradient ([Note: usage flags])


class PendingReduce:
    """A unit's gradient reduction in flight: the reduce-scatter (``work``), then on HYBRID_SHARD
    the all-reduce across replicas (``start_replicate``), then ``finish()`` adds the result into
    the shards."""

    def __init__(
        self, spec: ReduceSpec, work: Pending, flat: torch.Tensor, output: torch.Tensor, params: list[ShardedParam]
    ) -> None:
        self.spec, self.work, self.flat, self.output, self.params = spec, work, flat, output, params
        self.used: list[bool] = []  # per parameter: this rank had a gradient ([Note: usage flags])
        self.nbytes = 0  # the buffers' bytes in the memory account, released by finish() or release()
        self.replicating: Pending | None = None

    def start_replicate(self) -> bool:
        """Wait for the reduce-scatter and, on HYBRID_SHARD, issue the all-reduce of its output
        across replicas without waiting for it ([Note: replicas reduce behind compute]); whether
        one is in flight."""
        self.work.wait()
        spec = self.spec
        if spec.shard_comm.size > 1 and spec.replicate_comm.size > 1:
            stamped = spec.stamp_slots > 0
            self.replicating = collectives.all_reduce(self.output, spec.replicate_comm, spec.ctx, spec.unit, stamped)
        return self.replicating is not None

    def finish(self) -> list[UndecidedGrad]:
        """Wait for what is in flight, divide, add into ``sharded.grad``; return the gradients of
        parameters this rank did not use ([Note: usage flags])."""
        if self.replicating is None:
            self.start_replicate()
        if self.replicating is not None:
            self.replicating.wait()
        undecided = _apply_reduced(self.spec, self.output, self.params, self.used)
        self.release()
        return undecided

    def wait(self) -> None:
        """Wait for every collective of it (a failed iteration drops the result)."""
        self.work.wait()
        if self.replicating is not None:
            self.replicating.wait()

    def release(self) -> None:
        """Take its buffers out of the memory account (once finished or dropped)."""
        self.spec.memory.freed(self.spec.unit, self.nbytes, "reduce_buffer")


def start_reduce(spec: ReduceSpec, params: list[ShardedParam]) -> PendingReduce:
    """Flatten the full gradients of ``params`` (zeros where this rank has none) with their usage
    flags, start ONE reduction and free them ([Note: usage flags]).

    FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD: a reduce-scatter in the shard group (HYBRID then
    all-reduces the shard across replicas in ``PendingReduce.start_replicate``). NO_SHARD: one
    in-place all-reduce of the flat buffer, which the sharded gradients then view (one copy in all).
    """
    sizes = [p.real_shard_numel for p in params]  # [Note: flat buffers of any dtype]
    total = sum(sizes)
    world, stamp = spec.shard_comm.size, spec.stamp_slots
    flat = torch.empty(world, total + len(params) + stamp, dtype=spec.dtype, device=spec.device_layer.compute)
    stashed = sum(p.stashed_nbytes for p in params)
    with span("reduce_copy_in"):
        used = [p.take_grad_rows(columns) for p, columns in zip(params, flat[:, :total].split(sizes, dim=1))]
    spec.ctx.record_copy("reduce_copy_in", world * total * flat.element_size())
    if spec.divide_before != 1:  # [Note: SUM then divide]: float16's share of the divide before the sum
        flat[:, :total].div_(spec.divide_before)
    spec.memory.freed(spec.unit, stashed, "stashed_grads")
    flat[:, total : total + len(params)].fill_(1)
    for index, has_grad in enumerate(used):
        if not has_grad:
            flat[:, total + index].zero_()
    if world == 1:
        output = flat.view(-1)
        work = collectives.all_reduce(output, spec.replicate_comm, spec.ctx, spec.unit, stamped=stamp > 0)
        nbytes = flat.numel() * flat.element_size()
    else:
        output = flat.new_empty(total + len(params) + stamp)
        work = collectives.reduce_scatter(output, flat.view(-1), spec.shard_comm, spec.ctx, spec.unit, stamp > 0)
        scratch = collectives.reduce_scatter_scratch_numel(output, spec.shard_comm, spec.ctx)
        nbytes = (flat.numel() + output.numel() + scratch) * flat.element_size()
    pending = PendingReduce(spec, work, flat, output, params)
    pending.used, pending.nbytes = used, nbytes
    spec.memory.allocated(spec.unit, nbytes, "reduce_buffer")
    return pending


def _apply_reduced(
    spec: ReduceSpec, output: torch.Tensor, params: list[ShardedParam], used: list[bool]
) -> list[UndecidedGrad]:
    """Divide the reduced gradients by the data-parallel size, add them into the shards of the
    parameters this rank used; return the others for a later decision."""
    with span("reduce_apply"):
        total = output.numel() - len(params) - spec.stamp_slots
        grads, flags = output[:total], output[total : total + len(params)]
        grads.div_(spec.divide_after)  # [Note: SUM then divide]
        undecided = []
        pieces = grads.split([p.real_shard_numel for p in params])
        for param, piece, flag, has_grad in zip(params, pieces, flags, used):
            if has_grad:
                param.accumulate_sharded_grad(piece, spec.device_layer)
                run_post_accumulate_hooks(param.sharded, spec.device_layer)
            else:
                undecided.append(UndecidedGrad(param, piece, flag))
    return undecided
