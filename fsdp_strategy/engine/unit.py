"""FSDPUnit: the parameters that are gathered together and reduced together.

A unit does *what*: one all-gather of all its shards, the copy-out into full parameters, one
reduction of all its gradients, the swap back to shards. It registers no hooks and decides
no order; the Scheduler (runtime.py) decides *when*, from the unit's ``UnitState`` (state.py).

Its bytes (the gather and reduce buffers, their copies and collectives) are buffers.py's
([Note: usage flags] there).

Changes made to gathered full parameters are kept in the shards by edits.py ([Note: edits while
gathered]).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from enum import Enum, auto
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdp_strategy.engine import buffers, collectives
from fsdp_strategy.engine.accounting import MemoryAccount
from fsdp_strategy.engine.buffers import GatherResult
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.device import DeviceLayer
from fsdp_strategy.engine.edits import LostEdits, keep_full_edits
from fsdp_strategy.engine.flat import complex_from_real, real_dtype
from fsdp_strategy.engine.iteration import PostBackward
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.param_hooks import share_grad_hooks
from fsdp_strategy.engine.state import AfterPostBackward, Frame, UnitState
from fsdp_strategy.engine.traversal import grad_tensors, replace_grad_tensors


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
    comm: CommContext  # the engine's collectives' ledger, recorder, watchdog and exchange
    memory: MemoryAccount  # counts the buffers gathering and reducing allocate
    device_layer: DeviceLayer  # every pinned buffer, non_blocking copy and event ([Note: host and device])
    lost_edits: LostEdits  # changes a lower param_dtype could not keep ([Note: edits while gathered])
    stamp_slots: int = 0  # elements per rank each collective carries for its order stamp ([Note: order stamps])


def default_reduce_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """A unit's reduce dtype without ``mixed_precision.reduce_dtype``: its parameters' real dtypes
    promoted together, float8 ones left out (torch promotes none of them: a frozen float8 base weight
    beside a LoRA adapter; a float8 gradient is reduced in the others' dtype, float32 if alone)."""
    promotable = [real_dtype(d) for d in dtypes if not (d.is_floating_point and d.itemsize == 1)]
    return functools.reduce(torch.promote_types, promotable or [torch.float32])


class FSDPUnit:
    """One unit: its ShardedParams, their flat layout, and gather / reduce / reshard.

    Costs: while gathered, the full parameters in ``param_dtype``; during a gather, also the
    gather buffer (the full size again) until the copy-out; during a reduction, the unit's
    trainable full size in ``reduce_dtype`` plus one shard of it.
    """

    def __init__(
        self, name: str, module: nn.Module, params: list[ShardedParam], context: UnitContext, is_root: bool = False
    ) -> None:
        self.name = name
        self.parent = None if is_root else name.rpartition(".")[0]  # the module it is called from ("": the root)
        self.training = UnitState(is_root)  # where it is in the iteration (state.py); the Scheduler drives it
        self.module = module
        self.params = params
        self.shard_comm = context.shard_comm
        self.replicate_comm = context.replicate_comm
        self.device = context.device
        self.comm = context.comm
        self.memory = context.memory
        self.device_layer = context.device_layer
        self.state = ShardedState.SHARDED
        self.lost_edits = context.lost_edits
        self._gathered_versions: list[int] = []  # shard versions when a gather in flight copied them
        self._aliased = bool(params) and all(p.aliased for p in params)  # [Note: aliased shards]
        self._stamp_slots = context.stamp_slots
        self.unsharded_nbytes = sum(p.unsharded_nbytes for p in params)  # full parameters, padding included
        self._gather: GatherResult | None = None
        self._param_dtypes = [p.param_dtype for p in params]  # gathered in these ([Note: flat buffers of any dtype])
        self._reduce_dtype = context.reduce_dtype or default_reduce_dtype([p.sharded.dtype for p in params])
        data_parallel_size = self.shard_comm.size * self.replicate_comm.size
        divide_before, divide_after = collectives.divide_factors(data_parallel_size, self._reduce_dtype)
        self._reduce = buffers.ReduceSpec(
            name,
            self.shard_comm,
            self.replicate_comm,
            context.comm,
            context.device_layer,
            context.memory,
            self._reduce_dtype,
            divide_before,
            divide_after,
            context.stamp_slots,
        )

    # ---- forward ----------------------------------------------------------------------

    def enter_forward(self, in_backward: bool) -> Frame:
        """A call of its forward begins (its pre-hook): the call is noted, the unit gathered; the
        root is exposed (``training_step`` runs inside it: [Note: edits while gathered])."""
        frame = Frame(sys.exc_info()[1])
        self.training.forward_entered(frame, in_backward)
        self.wait_unshard()
        if self.training.is_root:
            self.training.expose()
        return frame

    def arm_post_backward(
        self, frame: Frame, in_backward: bool, args: tuple, kwargs: dict, post_backward: Callable[..., None]
    ) -> tuple[tuple, dict]:
        """Put ``PostBackward`` on the call's inputs that need gradients, to call
        ``post_backward(unit, state, counted)`` once their gradients are computed ([Note:
        post-backward every rank agrees on]); note a call whose inputs need none ([Note: calls
        without a post-backward])."""
        tensors = grad_tensors((args, kwargs))
        if not tensors:
            if not in_backward:
                self.training.call_uncovered()
            return args, kwargs
        frame.counted = not in_backward  # a recomputation's post-backward may never fire
        callback = functools.partial(post_backward, self, self.training, frame.counted)
        outputs = PostBackward.apply(callback, *tensors)
        self.training.post_backward_armed(frame.counted)
        frame.input_ids = frozenset(map(id, outputs))
        return replace_grad_tensors((args, kwargs), list(outputs))

    def leave_forward(self, frame: Frame, output: Any, backward_hook: Any, root_depth: int, policy: bool) -> bool:
        """A call of its forward returned (its post-hook): its outputs get ``backward_hook``, and by
        the rule (state.py) and the policy (``reshard_after_forward``) it reshards, or stays gathered
        and exposed ([Note: edits while gathered]). Whether an output was hooked."""
        hooked = False
        if torch.is_grad_enabled():
            for tensor in grad_tensors(output):
                if id(tensor) not in frame.input_ids:  # a unit returning its input: backward is not its own
                    tensor.register_hook(backward_hook)
                    hooked = True
        if not self.training.on_stack:
            if self.training.reshards_after_forward(hooked, root_depth, policy):
                self.reshard(keep_edits=True)  # its own forward may have changed it
            else:
                self.training.expose()
        return hooked

    def forward_raised(self, frame: Frame, root_depth: int) -> None:
        """A call of its forward raised: the call is forgotten and, off the stack, the unit resharded."""
        self.training.forward_raised(frame)
        if not self.training.on_stack and self.training.reshards_after_forward(False, root_depth, True):
            self.reshard()

    # ---- backward ---------------------------------------------------------------------

    def reached_in_backward(self) -> bool:
        """Backward reached one of its outputs (its pre-backward hook): gathered again, unless
        another call of it was reached first. Whether this one is the first."""
        if not self.training.backward_reached():
            return False
        self.wait_unshard()
        return True

    def post_backward(self, counted: bool, create_graph: bool) -> AfterPostBackward:
        """The gradients of a call's inputs are computed (its ``PostBackward``): resharded unless
        another call or a double backward still needs it ([Note: forward on the stack], [Note:
        double backward]); ``READY`` when its gradients are complete."""
        outcome = self.training.post_backward_fired(counted, create_graph)
        if outcome is not AfterPostBackward.KEEP and self.training.may_reshard():
            self.reshard()
        return outcome

    def due_for_reduction(self) -> bool:
        """At the end of backward: whether it has gradients no reduction took yet."""
        return self.training.needs_reduction(self.state is ShardedState.UNSHARDED)

    def end_backward(self, create_graph: bool) -> None:
        """The backward pass ended: resharded unless a double backward keeps it gathered."""
        if not self.training.keeps_after_backward(create_graph):
            self.reshard()
        self.training.backward_finished(create_graph)

    def reset(self) -> None:
        """A failed iteration: its state forgotten, its unreduced gradients dropped, resharded
        without keeping changes of the full parameters."""
        self.training.reset()
        self.drop_grads()
        self.reshard(keep_edits=False)

    def pin(self) -> None:
        """Hold it gathered (``summon_full_params``) until ``unpin``; starts its gather."""
        self.training.pin()
        self.unshard()

    def unpin(self, keep_edits: bool) -> None:
        """Release ``pin``: resharded (changes kept with ``keep_edits``) unless it runs."""
        if self.training.unpin():
            self.reshard(keep_edits=keep_edits)

    # ---- gather -----------------------------------------------------------------------

    def unshard(self) -> None:
        """Start the all-gather of the unit's shards (no-op unless the unit is sharded)."""
        if self.state is not ShardedState.SHARDED or not self.params or self._aliased:
            return
        self._gathered_versions = [p.sharded._version for p in self.params]
        self._gather = self._start_gather([p.sharded for p in self.params], self._param_dtypes)
        self.memory.allocated(self.name, self._gather.nbytes, "gather_buffer")
        self.state = ShardedState.GATHERING

    def _start_gather(self, shards: list[torch.Tensor], dtypes: list[torch.dtype]) -> GatherResult:
        """One all-gather of a shard-shaped tensor per parameter, cast to ``dtypes`` (buffers.py)."""
        return buffers.start_gather(
            self.name, shards, dtypes, self.shard_comm, self.comm, self.device_layer, self._stamp_slots
        )

    def _gather_is_stale(self) -> bool:
        """Whether a shard changed in place after a prefetched gather copied it (an optimizer step,
        ``with torch.no_grad(): p.mul_(...)`` between two units' calls): every rank changed its own
        alike, so every rank finds it and gathers again. ``p.data.<op>_()`` leaves no trace."""
        return [p.sharded._version for p in self.params] != self._gathered_versions

    def wait_unshard(self) -> None:
        """Make the full parameters usable: start the gather if needed, wait, copy out, register.

        ``requires_grad`` of every parameter is reconciled ([Note: requires_grad on either side]),
        so freezing and unfreezing between (or during) steps takes effect at the next use.
        """
        for param in self.params:
            param.sync_requires_grad()
        share_grad_hooks(self.params)  # [Note: gradient hooks on parameters]
        if self.state is ShardedState.UNSHARDED:
            return
        if self._aliased or not self.params:
            for param in self.params:
                param.install(unsharded=True)
                param.mark_filled()  # what keep_edits compares with
            self.state = ShardedState.UNSHARDED
            return
        self.unshard()
        if self._gather is not None and self._gather_is_stale():
            self.reshard(keep_edits=False)  # waits for the stale gather and frees its buffer
            self.unshard()
        gather, self._gather = self._gather, None
        self._copy_out(gather)
        for param in self.params:
            param.install(unsharded=True)
        self.memory.allocated(self.name, self.unsharded_nbytes, "params")
        self.memory.freed(self.name, gather.nbytes, "gather_buffer")
        self.state = ShardedState.UNSHARDED

    def _copy_out(self, gather: GatherResult) -> None:
        """Wait for ``gather`` and fill the full parameters from it (their versions kept)."""
        targets = [param.allocate_unsharded() for param in self.params]
        buffers.copy_out(gather, targets, self.comm, self.unsharded_nbytes)
        for param in self.params:
            param.mark_filled()

    def refresh(self, changed: set[int]) -> None:
        """Gather a gathered unit again after its shards changed (an optimizer step while it was
        gathered: [Note: edits while gathered]). The full parameters whose shard ids are in
        ``changed`` get a new version; the others are rewritten with the values they hold.
        Costs: one all-gather of the unit and its gather buffer while in flight."""
        if self.state is not ShardedState.UNSHARDED or self._aliased or not self.params:
            return
        gather = self._start_gather([p.sharded for p in self.params], self._param_dtypes)
        self.memory.allocated(self.name, gather.nbytes, "gather_buffer")
        self._copy_out(gather)
        self.memory.freed(self.name, gather.nbytes, "gather_buffer")
        for param in self.params:
            if id(param.sharded) in changed:
                torch.autograd.graph.increment_version(param.unsharded)
                param.mark_filled()

    def keep_edits(self, every_param: bool) -> None:
        """Write changes of the full parameters back into the shards ([Note: edits while gathered]):
        of every parameter, or of those with a visible trace only. A change that cannot be kept
        exactly is checked on the device and reported later by ``lost_edits``, without a wait."""
        if self.state is not ShardedState.UNSHARDED:
            return
        # [Note: aliased shards]: a change in place is the shard's own; new ``.data`` (a visible trace) is not
        self.lost_edits.add(keep_full_edits(self.name, self.params, every_param and not self._aliased))

    def reshard(self, keep_edits: bool | None = None) -> None:
        """Register the shards again and free the full parameters (and any gather in flight).

        ``keep_edits``: write changes of the full parameters back first ([Note: edits while
        gathered]): True for every parameter, None (default) for every parameter of an exposed
        unit and the visibly changed ones of others, False for none (a failed iteration,
        ``summon_full_params`` without writeback)."""
        if self._gather is not None:
            gather, self._gather = self._gather, None
            gather.wait()
            self.memory.freed(self.name, gather.nbytes, "gather_buffer")
        exposed = self.training.covered()
        try:
            if self.state is ShardedState.UNSHARDED and keep_edits is not False:
                self.keep_edits(every_param=bool(keep_edits) or exposed)
        finally:  # also when an edit is refused: the module gets its shards back, not the refused data
            if self.state is ShardedState.UNSHARDED:
                for param in self.params:
                    param.sync_requires_grad()  # a change made to the full parameter outlives it
                    param.install(unsharded=False)
                    param.free_unsharded()
                if not self._aliased:
                    self.memory.freed(self.name, self.unsharded_nbytes, "params")
                    self.device_layer.resharded()
            self.state = ShardedState.SHARDED

    def gather_full(self, shards: list[torch.Tensor], keep: bool = True) -> list[torch.Tensor]:
        """All-gather one shard-shaped tensor per parameter (in its own dtype) into full tensors.

        Used for checkpoints: the fp32 master weights and optimizer state, not ``param_dtype``.
        With ``keep=False`` this rank only contributes its shards and gets ``[]``.
        Costs: the unit's full size in that dtype, on the compute device, until returned.
        """
        if not self.params:
            return []
        dtypes = [s.dtype for s in shards]
        gather = self._start_gather(shards, dtypes)
        gather.wait()
        if not keep:
            return []
        rows = [complex_from_real(c, d) if d.is_complex else c for c, d in zip(gather.pieces(), dtypes)]
        fulls = [param.full_from_rows(r) for param, r in zip(self.params, rows)]
        if gather.layout.bytes_mode:  # views of one byte buffer as several dtypes: torch.save refuses them
            fulls = [full.clone() for full in fulls]
        return fulls

    # ---- reduce -----------------------------------------------------------------------

    def stash_grads(self) -> None:
        """no_sync: keep each full gradient (summed in ``reduce_dtype``) for the next reduction."""
        self._drop_cleared_stashes()
        for param in self.params:
            if param.trainable:
                self.memory.allocated(self.name, param.stash_grad(self._reduce_dtype), "stashed_grads")
            else:
                param.drop_grads()

    def reduce_grads(self) -> buffers.PendingReduce | None:
        """Start ONE reduction of the trainable parameters' full gradients (buffers.py:
        ``start_reduce``) and drop the frozen ones'. None without trainable parameters."""
        self._drop_cleared_stashes()
        params = []
        for param in self.params:
            if param.trainable:
                params.append(param)
            else:
                param.drop_grads()
        return buffers.start_reduce(self._reduce, params) if params else None

    def _drop_cleared_stashes(self) -> None:
        """Discard the stashed gradients whose parameters' gradients were zeroed since ([Note:
        zero_grad under no_sync] in param.py)."""
        cleared = [param for param in self.params if param.stash_cleared()]
        if cleared:  # rare: the common reduction only looks (no stash, or one still current)
            self.memory.freed(self.name, sum(param.stashed_nbytes for param in cleared), "stashed_grads")
            for param in cleared:
                param.stashed_grad = None

    def drop_grads(self) -> None:
        """Discard every full and stashed gradient of the unit (a failed iteration)."""
        stashed = sum(p.stashed_nbytes for p in self.params)
        for param in self.params:
            param.drop_grads()
        self.memory.freed(self.name, stashed, "stashed_grads")
