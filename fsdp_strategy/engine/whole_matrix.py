"""Optimizers whose update of a parameter reads the whole parameter (torch's Muon and Adafactor,
LAMB, SOAP, Shampoo, ... measured or declared so) stepping a sharded model exactly.

[Note: whole-matrix placement]
Muon orthogonalizes each matrix's momentum, Adafactor factorizes its second moment into row and
column statistics, LAMB scales each update by norms: on a block of rows they compute something
else. So each parameter is stepped whole, on one rank of the shard group (its owner; owners are
chosen once per optimizer, largest parameter first to the rank with the fewest elements so far, so
each rank steps about 1/N of them):
1. right before the update (after the closure, if the step has one), ONE all-to-all sends each
   owner every rank's rows of its parameters, of their gradients and of their row-shaped state (a
   momentum of the parameter's shape: kept sharded at rest, as an elementwise optimizer's state);
2. the optimizer's own ``step`` runs on the owner with its param groups and state pointed at
   stand-in whole parameters, and no rank steps a parameter it does not own;
3. after it, ONE all-to-all sends each rank its rows of the updated parameters and row-shaped state.
State that is not shaped like its parameter (Adafactor's row and column statistics, SOAP's and
Shampoo's preconditioners and eigenbases, step counts, plain Python values) stays with the owner
and never travels: no rank but the owner holds it. At a parameter's first step its state is
created on the owner only: the owners then tell the other ranks its layout (names, shapes, dtypes:
one small object gather); a layout that changes later is an error on every rank. A checkpoint
holds the owner's state under the parameter's name; loaded (on any world size, where the owner may
be another rank) every rank reads it, and after the next step only the owner keeps it.

At rest the parameters are shards as for an elementwise optimizer. Costs per step: the parameters,
gradients and row-shaped state cross the group once each way (the gradients only towards the
owner): for Muon about 5x the parameters' bytes, in two all-to-alls (in the communication ledger
as ``all_to_all``); memory during the step: the rank's owned parameters, whole, with their
gradients and state (about 1/N of all of them), plus the two payloads; at rest, the owner-held
state of about 1/N of the parameters per rank.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdp_strategy.engine import collectives, control
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.diagnosis import count_of
from fsdp_strategy.engine.param import ShardedParam
from fsdp_strategy.engine.state_layout import StateEntry, entry_at_rest, entry_of_whole, later_layout, placed_for_step


class _Step(NamedTuple):
    """An optimizer step in progress on whole matrices."""

    groups: list[list[Any]]  # each param group's parameters, as the optimizer had them
    stepped: list[ShardedParam]  # the sharded parameters with a gradient, in the optimizer's order
    owners: dict[int, int]  # id(shard) -> owner rank
    proxies: dict[int, nn.Parameter]  # id(shard) -> its whole stand-in (on its owner)
    first: bool  # some parameter takes its first step: the owners publish the state layouts
    dtype: torch.dtype  # of both payloads (the same on every rank)


class WholeMatrixSteps:
    """Places the matrices of whole-matrix optimizers whole for their steps ([Note: whole-matrix
    placement]). Costs: see the note; nothing between steps."""

    def __init__(self, params: Sequence[ShardedParam], comm: CommGroup, ctx: CommContext, device: torch.device):
        self._by_id = {id(p.sharded): p for p in params}
        self._comm, self._ctx, self._device = comm, ctx, device
        self._owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (ids, owners)
        self._layouts: dict[int, tuple[StateEntry, ...]] = {}  # id(shard) -> its state layout
        self._loaded_rows: dict[int, dict[str, bool]] = {}  # id(shard) -> {key: row-shaped}, as a load found it
        self._steps: dict[int, _Step] = {}  # id(optimizer) -> the step in progress
        self._seen: weakref.WeakSet = weakref.WeakSet()  # optimizers whose layouts these are
        self._proxies: dict[int, nn.Parameter] = {}  # id(shard) -> its whole stand-in on its owner

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any of these sharded parameters."""
        return any(id(p) in self._by_id for group in optimizer.param_groups for p in group["params"])

    def describe(self, optimizer: torch.optim.Optimizer) -> str | None:
        """How ``optimizer``'s matrices are placed, once it has stepped (None before, or if it holds
        none of them): their count, each rank's share and the traffic per step."""
        placed = self._owners.get(optimizer)
        if placed is None or not placed[1]:
            return None
        counts, elements = [0] * self._comm.size, [0] * self._comm.size
        for param_id, rank in placed[1].items():
            counts[rank] += 1
            elements[rank] += math.prod(self._by_id[param_id].global_shape)
        shares = ", ".join(f"rank {r} {n} ({count_of(e)} elements)" for r, (n, e) in enumerate(zip(counts, elements)))
        return (
            f"{type(optimizer).__name__} steps each of its {len(placed[1])} sharded parameters whole on one rank of "
            f"the {self._comm.size} that shard it: {shares}; the other ranks' rows go there and back in two "
            "all-to-alls per step (about 5x the parameters' bytes for Muon)"
        )

    # ---- before the update ---------------------------------------------------------------------

    @torch.no_grad()
    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Gather each stepped matrix whole on its owner and point the optimizer at the stand-ins."""
        self._adopt(optimizer)
        stepped = [
            self._by_id[id(p)]
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in self._by_id and p.grad is not None
        ]
        owners = self._owners_of(optimizer)
        me, world = self._comm.rank, self._comm.size
        layouts = [self._layout(optimizer, p) for p in stepped]  # every one read: a later one may hold state
        first = not all(layouts)
        owned = [[p for p in stepped if owners[id(p.sharded)] == rank] for rank in range(world)]
        pieces = [self._rows_to_send(optimizer, p) for rank in range(world) for p in owned[rank]]
        dtype = self._payload_dtype(pieces)
        sizes = [sum(p.shard_numel * len(self._row_slots(p)) for p in owned[rank]) for rank in range(world)]
        send = torch.cat([t.reshape(-1).to(self._device, dtype) for piece in pieces for t in piece]) if pieces else None
        received = self._all_to_all(send, sizes, [sizes[me]] * world, dtype)
        proxies = self._stand_ins(optimizer, owned[me], received, world)
        groups = [list(group["params"]) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["params"] = [
                proxies.get(id(p), p)
                for p in group["params"]
                if id(p) in proxies or not (id(p) in self._by_id and p.grad is not None)
            ]
        self._steps[id(optimizer)] = _Step(groups, stepped, owners, proxies, first, dtype)

    def _adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """The first step (or load) of an optimizer: layouts another optimizer learnt for the same
        parameters (an earlier phase's, a tuner's) are not its own."""
        if optimizer in self._seen:
            return
        self._seen.add(optimizer)
        for group in optimizer.param_groups:
            for param in group["params"]:
                self._layouts.pop(id(param), None)
                self._loaded_rows.pop(id(param), None)

    def _owners_of(self, optimizer: torch.optim.Optimizer) -> dict[int, int]:
        """The owner of each matrix of ``optimizer``: largest first, to the least loaded rank (the
        same on every rank). A parameter keeps its owner while the optimizer holds it (a param group
        added later, as progressive unfreezing does, places only its own parameters): the state only
        an owner holds stays where it is."""
        ids = tuple(id(p) for group in optimizer.param_groups for p in group["params"] if id(p) in self._by_id)
        cached = self._owners.get(optimizer)
        if cached is not None and cached[0] == ids:
            return cached[1]
        kept = {i: rank for i, rank in (cached[1] if cached is not None else {}).items() if i in ids}
        load = [0] * self._comm.size
        for param_id, rank in kept.items():
            load[rank] += self._by_id[param_id].shard_numel
        owners = dict(kept)
        for param_id in sorted(ids, key=lambda i: (-self._by_id[i].shard_numel, ids.index(i))):
            if param_id in owners:
                continue
            rank = min(range(self._comm.size), key=lambda r: (load[r], r))
            owners[param_id] = rank
            load[rank] += self._by_id[param_id].shard_numel
        self._owners[optimizer] = (ids, owners)
        return owners

    def _layout(self, optimizer: torch.optim.Optimizer, param: ShardedParam) -> tuple[StateEntry, ...]:
        """``param``'s state layout: learnt at its first step, or read from the state at rest (a state
        loaded from a checkpoint: row-shaped tensors have the shard's shape on every rank)."""
        known = self._layouts.get(id(param.sharded))
        if known is None:
            state = optimizer.state.get(param.sharded, {})
            hints = self._loaded_rows.get(id(param.sharded), {})
            known = tuple(entry_at_rest(param, key, value, hints.get(key)) for key, value in sorted(state.items()))
            if known:
                self._layouts[id(param.sharded)] = known
        return known

    def _row_slots(self, param: ShardedParam) -> list[str | None]:
        """What travels in rows for ``param``: the parameter (None), its gradient ("grad") and its
        row-shaped state, in a fixed order (its layout is known: ``_layout`` ran first)."""
        layout = self._layouts.get(id(param.sharded), ())
        return [None, "grad", *(entry.key for entry in layout if entry.rows)]

    def _rows_to_send(self, optimizer: torch.optim.Optimizer, param: ShardedParam) -> list[torch.Tensor]:
        state = optimizer.state.get(param.sharded, {})
        tensors = []
        for slot in self._row_slots(param):
            if slot is None:
                tensors.append(param.sharded.detach())
            elif slot == "grad":
                tensors.append(param.sharded.grad)
            else:
                tensors.append(state[slot])
        return tensors

    @staticmethod
    def _payload_dtype(pieces: list[list[torch.Tensor]]) -> torch.dtype:
        dtypes = [t.dtype for piece in pieces for t in piece]
        return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32

    def _all_to_all(
        self, send: torch.Tensor | None, out_sizes: list[int], in_sizes: list[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """One all-to-all of the shard group (elements to and from each rank), waited for."""
        received = torch.empty(sum(in_sizes), dtype=dtype, device=self._device)
        if not sum(out_sizes) and not sum(in_sizes):
            return received
        if send is None:
            send = torch.empty(0, dtype=dtype, device=self._device)
        collectives.all_to_all(received, send, in_sizes, out_sizes, self._comm, self._ctx, "whole_matrix").wait()
        return received

    def _stand_ins(
        self, optimizer: torch.optim.Optimizer, mine: list[ShardedParam], received: torch.Tensor, world: int
    ) -> dict[int, nn.Parameter]:
        """Whole stand-ins of this rank's matrices (gradient and state set) from every rank's rows."""
        chunk = received.numel() // world if world else 0
        per_rank = received.view(world, chunk) if chunk else received.view(world, 0)
        proxies, offset = {}, 0
        for param in mine:
            slots = self._row_slots(param)
            whole = []
            for _ in slots:
                rows = per_rank[:, offset : offset + param.shard_numel]
                whole.append(param.full_from_rows(rows))
                offset += param.shard_numel
            proxy = self._proxy(param)
            proxy.data = whole[0].to(param.sharded.dtype).clone()
            proxy.requires_grad_(param.sharded.requires_grad)
            proxy.grad = whole[1].to(param.sharded.grad.dtype).clone()
            state = {}
            layout = {entry.key: entry for entry in self._layouts.get(id(param.sharded), ())}
            for key, value in zip(slots[2:], whole[2:]):
                state[key] = value.to(layout[key].dtype).clone()
            for key, value in optimizer.state.get(param.sharded, {}).items():
                if key not in state:  # whole on every rank already: this rank's copy
                    state[key] = placed_for_step(optimizer, param, key, value, self._device)
            if state:
                optimizer.state[proxy] = state
            proxies[id(param.sharded)] = proxy
        return proxies

    def _proxy(self, param: ShardedParam) -> nn.Parameter:
        """``param``'s whole stand-in: the same object at every step (an optimizer may key what it keeps
        by the parameter object), holding memory only during a step."""
        proxy = self._proxies.get(id(param.sharded))
        if proxy is None:
            proxy = self._proxies[id(param.sharded)] = nn.Parameter(torch.empty(0, dtype=param.sharded.dtype))
        return proxy

    def _release(self, step: _Step) -> None:
        """Free the stand-ins' memory until their next step (their identity stays)."""
        for proxy in step.proxies.values():
            proxy.grad = None
            proxy.data = proxy.data.new_empty(0)

    def abandon(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget a step of ``optimizer`` that raised after its matrices were gathered: its param
        groups point at the shards again (the shards and their state are as before that step)."""
        step = self._steps.pop(id(optimizer), None)
        if step is None:
            return
        for group, params in zip(optimizer.param_groups, step.groups):
            group["params"] = params
        for proxy in step.proxies.values():
            optimizer.state.pop(proxy, None)
        self._release(step)

    # ---- after the update ----------------------------------------------------------------------

    @torch.no_grad()
    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Give every rank its rows of the updated matrices and state; point the optimizer back."""
        step = self._steps.pop(id(optimizer), None)
        if step is None:
            return
        for group, params in zip(optimizer.param_groups, step.groups):
            group["params"] = params
        me, world = self._comm.rank, self._comm.size
        states = {key: optimizer.state.pop(proxy, {}) for key, proxy in step.proxies.items()}
        self._learn_layouts(step, states)
        owned = [[p for p in step.stepped if step.owners[id(p.sharded)] == rank] for rank in range(world)]
        send = self._rows_back(step, owned[me], states, world)
        sizes = [sum(self._back_numel(p) for p in owned[rank]) for rank in range(world)]
        received = self._all_to_all(send, [sizes[me]] * world, sizes, step.dtype)
        offset = 0
        for rank in range(world):
            for param in owned[rank]:
                offset = self._take_back(optimizer, param, received, offset)
                self._keep_apart(optimizer, param, states.get(id(param.sharded)) if rank == me else None)
        self._release(step)

    def _learn_layouts(self, step: _Step, states: dict[int, dict[str, Any]]) -> None:
        """Each owner's state layouts after the step; published to every rank at a first step."""
        mine = {}
        for param in step.stepped:
            state = states.get(id(param.sharded))
            if state is None:
                continue
            layout = tuple(entry_of_whole(param, key, value) for key, value in sorted(state.items()))
            known = self._layouts.get(id(param.sharded))
            if known is not None and known != layout and not step.first:
                layout = later_layout(param, known, layout)
            mine[param.fqn] = layout
        if step.first:
            everyone: dict[str, tuple[StateEntry, ...]] = {}
            for part in control.all_gather_objects(mine, self._comm.group, control.watchdog_of(self._ctx)):
                everyone.update(part)
            for param in step.stepped:
                if param.fqn in everyone:
                    self._layouts[id(param.sharded)] = everyone[param.fqn]
        else:
            for param in step.stepped:
                if param.fqn in mine:
                    self._layouts[id(param.sharded)] = mine[param.fqn]

    def _back_numel(self, param: ShardedParam) -> int:
        """Elements each rank receives for ``param``: its rows of the parameter and of row-shaped state."""
        layout = self._layouts.get(id(param.sharded), ())
        return (1 + sum(entry.rows for entry in layout)) * param.shard_numel

    def _rows_back(
        self, step: _Step, mine: list[ShardedParam], states: dict[int, dict[str, Any]], world: int
    ) -> torch.Tensor | None:
        """The payload this owner sends back: for each rank, its rows of each owned parameter and of its
        row-shaped state (the rest stays here)."""
        parts = []
        for rank in range(world):
            for param in mine:
                proxy, state = step.proxies[id(param.sharded)].detach(), states.get(id(param.sharded), {})
                parts.append(param.local_rows(proxy, rank).reshape(-1))
                for entry in self._layouts.get(id(param.sharded), ()):
                    if entry.rows:
                        parts.append(param.local_rows(state[entry.key], rank).reshape(-1))
        return torch.cat([part.to(self._device, step.dtype) for part in parts]) if parts else None

    def _take_back(
        self, optimizer: torch.optim.Optimizer, param: ShardedParam, received: torch.Tensor, offset: int
    ) -> int:
        """Write this rank's rows of ``param`` and its state from ``received`` at ``offset``; the new offset."""
        rows = received[offset : offset + param.shard_numel]
        param.sharded.copy_(rows.view(param.sharded.shape))
        offset += param.shard_numel
        state = optimizer.state[param.sharded]
        for entry in self._layouts.get(id(param.sharded), ()):
            if entry.rows:
                value = received[offset : offset + param.shard_numel].view(param.sharded.shape)
                state[entry.key] = value.to(device=param.sharded.device, dtype=entry.dtype).clone()
                offset += param.shard_numel
        return offset

    def _keep_apart(self, optimizer: torch.optim.Optimizer, param: ShardedParam, owned: dict | None) -> None:
        """The state not shaped like ``param``: the owner keeps its stand-in's (``owned``), on the shard's
        device but a 0-dim tensor where the optimizer left it (Adafactor's step count on the host, read
        there without a device wait); another rank drops any copy (one loaded from a checkpoint)."""
        state = optimizer.state[param.sharded]
        layout = self._layouts.get(id(param.sharded), ())
        for key in set(state) - {entry.key for entry in layout}:  # the optimizer deleted it in its step
            del state[key]
        for entry in layout:
            if entry.rows:
                continue
            if owned is None:
                state.pop(entry.key, None)
                continue
            value = owned[entry.key]
            state[entry.key] = value.to(param.sharded.device) if torch.is_tensor(value) and value.ndim else value

    def loaded(self, optimizer: torch.optim.Optimizer, rows: dict[int, dict[str, bool]]) -> None:
        """A checkpoint was loaded into these shards' state of ``optimizer``: ``{id(shard): {key:
        row-shaped}}`` as the checkpoint had them (an entry of the shard's shape is not necessarily a
        row shard); the layouts learnt before are forgotten."""
        self._adopt(optimizer)
        for shard_id, keys in rows.items():
            self._layouts.pop(shard_id, None)
            self._loaded_rows[shard_id] = dict(keys)

    def apart_keys(self, optimizer: torch.optim.Optimizer) -> dict[int, set[str]]:
        """``id(shard) -> the state keys its owner alone holds`` for the parameters placed whole whose
        layout every rank knows (what checkpoints must not treat as row shards, whatever their shape)."""
        apart: dict[int, set[str]] = {}
        for group in optimizer.param_groups:
            for shard in group["params"]:
                layout = self._layouts.get(id(shard), ())
                hints = self._loaded_rows.get(id(shard), {})
                keys = {e.key for e in layout if not e.rows} | {k for k, rows in hints.items() if not rows}
                if keys:
                    apart[id(shard)] = keys
        return apart

    def held_apart(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """``id(shard) -> {key: value}``: the state not shaped like its parameter this rank holds as the
        owner (what a full checkpoint gathers from the owners)."""
        held: dict[int, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            for shard in group["params"]:
                param = self._by_id.get(id(shard))
                layout = self._layouts.get(id(shard), ()) if param is not None else ()
                state = optimizer.state.get(shard, {})
                apart = {e.key: state[e.key] for e in layout if not e.rows and e.key in state}
                if apart:
                    held[id(shard)] = apart
        return held
