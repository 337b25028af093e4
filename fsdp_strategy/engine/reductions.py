"""Reductions: the gradient reductions of one backward, issued in the Scheduler's order and settled.

The Scheduler decides which unit reduces when, in the order below; this keeps what is in flight: at
most one reduction beyond the one just issued ([Note: bounded prefetch]), the gradients of
parameters this rank did not use until every rank's usage flag is known ([Note: usage flags] in
buffers.py), and whether ``no_sync`` accumulation holds the reductions back.

[Note: replicas reduce behind compute]
On HYBRID_SHARD a unit's reduce-scatter is followed by an all-reduce across replicas (between
nodes, the slowest link). Waiting for it at once would stall the compute stream behind it, as
FSDP2 avoids: it is issued when the reduce-scatter is done (at the next unit's reduction) and
waited for one reduction later, or at the end of backward, so the backward of the units between
runs while it is on the wire. In flight at most: one reduce-scatter and one all-reduce beyond the
reduction just issued (one unit's reduce buffers more than without replicas).

[Note: post-backward every rank agrees on]
Which parameters get gradients may differ between ranks (an expert without tokens, a head
chosen per batch), but the path of the graph through the units does not: the gradients of a
unit's inputs are computed at the same point of every rank's backward, after every node of the
unit's forward that reads its weights. A unit is ready there (at its k-th post-backward if it
ran k times) and reduces every trainable parameter, with zeros and usage flags where this
rank has no gradient ([Note: usage flags]). Reductions are issued in one order on every rank:
the reverse of the order in which units first ran forward (with grad) since they were last
reduced; a ready unit waits for the units before it, and the end-of-backward callback issues
whatever is left in that order (units whose inputs need no grad, like the first unit and the
root), then the units backward reached that forward did not list (in unit order). A unit that
backward does not reach on some ranks is therefore still reduced in the same place everywhere
(it only delays the reductions after it on those ranks). A unit that runs forward on some
ranks only, or that backward reaches on some ranks only under FULL_SHARD (its gather in
backward is a collective), cannot be supported by any FSDP: the ranks' collectives differ.
"""

from __future__ import annotations

from collections import deque

import torch

from fsdp_strategy.engine.buffers import PendingReduce, UndecidedGrad
from fsdp_strategy.engine.device import DeviceLayer
from fsdp_strategy.engine.param_hooks import run_post_accumulate_hooks
from fsdp_strategy.engine.trace import traced
from fsdp_strategy.engine.unit import FSDPUnit


class Reductions:
    """The reductions in flight for one model. Costs: a deque and a list."""

    def __init__(self, device_layer: DeviceLayer) -> None:
        self.device_layer = device_layer
        self.sync = True  # False inside ``no_sync``: gradients are stashed, not reduced
        self._in_flight: deque[PendingReduce] = deque()
        self._replicating: PendingReduce | None = None  # [Note: replicas reduce behind compute]
        self._undecided: list[UndecidedGrad] = []
        self._ran_forward: dict[FSDPUnit, None] = {}  # units that ran forward with grad since their last reduction

    def ran_forward(self, unit: FSDPUnit) -> None:
        """``unit`` ran forward with gradients enabled: it reduces in the next backward, in the
        reverse order of the forwards since the last backward (two root forwards before one backward
        included: the order outlives an iteration)."""
        self._ran_forward.setdefault(unit, None)

    def order(self) -> deque[FSDPUnit]:
        """The reduction order of the next backward ([Note: post-backward every rank agrees on])."""
        return deque(reversed(self._ran_forward))

    def forget_forwards(self) -> None:
        """A backward reduced them all (or the iteration failed): the next order starts empty."""
        self._ran_forward.clear()

    @traced("reduce")
    def reduce(self, unit: FSDPUnit) -> None:
        """Issue ``unit``'s reduction (or stash its gradients inside ``no_sync``), finishing the
        one before it first."""
        if not self.sync:
            unit.stash_grads()
            return
        pending = unit.reduce_grads()
        while self._in_flight:  # [Note: bounded prefetch]
            self._advance(self._in_flight.popleft())
        if pending is not None:
            self._in_flight.append(pending)

    def _advance(self, pending: PendingReduce) -> None:
        """Finish the all-reduce across replicas in flight, then move ``pending`` on: its own
        all-reduce issued (HYBRID_SHARD), or its result applied."""
        self._finish_replicating()
        if pending.start_replicate():
            self._replicating = pending
        else:
            self._undecided.extend(pending.finish())

    def _finish_replicating(self) -> None:
        if self._replicating is not None:
            replicating, self._replicating = self._replicating, None
            self._undecided.extend(replicating.finish())

    def settle(self) -> None:
        """Finish every reduction in flight and apply the gradients of parameters this rank did
        not use where another rank did ([Note: usage flags]: one device sync, only if any: the one
        host read of a step the engine keeps, since the gradient is None or a tensor by it)."""
        while self._in_flight:
            self._advance(self._in_flight.popleft())
        self._finish_replicating()
        undecided, self._undecided = self._undecided, []
        if not undecided:
            return
        counts = torch.stack([entry.flag for entry in undecided]).tolist()
        for entry, count in zip(undecided, counts):
            if count > 0:
                entry.param.accumulate_sharded_grad(entry.reduced, self.device_layer)
                run_post_accumulate_hooks(entry.param.sharded, self.device_layer)

    def buffers(self) -> list[torch.Tensor]:
        """The buffers of the reductions in flight (the reduce buffer and its output each)."""
        pendings = [*self._in_flight, *([self._replicating] if self._replicating is not None else [])]
        return [tensor for pending in pendings for tensor in (pending.flat, pending.output)]

    def drop(self) -> None:
        """A failed iteration: wait for what is in flight and forget every result."""
        pendings = [*self._in_flight, *([self._replicating] if self._replicating is not None else [])]
        self._in_flight.clear()
        self._replicating = None
        for pending in pendings:
            pending.wait()
            pending.release()
        self._undecided = []


def check_no_late_grads(units: list[FSDPUnit]) -> None:
    """Raise if a full parameter holds a gradient after every reduction (a use outside its unit)."""
    for unit in units:
        late = [p.fqn for p in unit.params if p.trainable and p.unsharded.grad is not None]
        if late:
            for param in unit.params:
                param.drop_grads()
            raise RuntimeError(
                f"fsdp_custom: parameters {late} of unit {unit.name!r} received gradients that no reduction "
                "covers: they were used outside their unit's forward (a weight read directly from another "
                "module, or an output modified in place, which drops its backward hook). Call the module "
                "that owns them, or put both modules in one unit (auto_wrap_policy)"
            )
