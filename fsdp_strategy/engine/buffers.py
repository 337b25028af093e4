"""A unit's gather in bytes: its shards copied into one flat buffer, one all-gather, the copy-out.

The shape is FSDP2's ``_fsdp_collectives``: ``start_gather`` (copy-in and the collective) returns a
``GatherResult``; ``GatherResult.wait()`` is the one place a stream waits for the gather (on NCCL
a CUDA stream, on gloo the host); ``copy_out`` fills the full parameters from it. The unit's
forward gather, its ``refresh`` after an optimizer step and ``gather_full`` (checkpoints) call the
same two functions. A unit decides *when* and keeps the memory account; here is *what* the bytes
do, with the copies counted in the ledger through the ``CommContext``.

Costs: the gather buffer, ``world x (shard elements + stamp slots)`` in the layout's dtype, from
``start_gather`` until the result is dropped; one copy of the shards in and one of the full
parameters out.
"""

from __future__ import annotations

import torch

from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.collectives import CommContext, CommGroup, Pending
from fsdp_strategy.engine.device import DeviceLayer
from fsdp_strategy.engine.flat import FlatLayout, real_dtype, real_view
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


def copy_out(result: GatherResult, targets: list[torch.Tensor], ctx: CommContext) -> None:
    """Wait for ``result`` and fill ``targets`` (the full parameters, flat rows in the padded
    layout) from it, their autograd versions kept."""
    result.wait()
    with torch.no_grad(), span("gather_copy_out"):
        reals = [t.view(real_dtype(t.dtype)) if t.is_complex() else t for t in targets]
        with torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
            if result.layout.bytes_mode:
                torch._foreach_copy_(reals, result.pieces())
            else:
                columns = result.gathered[:, : result.layout.total]
                torch.split_with_sizes_copy(columns, result.layout.sizes, dim=1, out=reals)
        ctx.record_copy("gather_copy_out", sum(t.numel() * t.element_size() for t in targets))
