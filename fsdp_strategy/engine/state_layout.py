"""A parameter's optimizer state as whole-matrix placement keeps it ([Note: whole-matrix placement]
in whole_matrix.py): which entries travel in rows (the parameter's shape: sharded at rest) and which
stay with the parameter's owner (any other shape or type)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsdp_strategy.engine.param import ShardedParam


class StateEntry(NamedTuple):
    """One entry of a parameter's optimizer state."""

    key: str
    rows: bool  # a tensor of the parameter's shape: sharded by rows at rest (else held by the owner only)
    shape: tuple[int, ...] | None  # the whole tensor's shape (None: not a tensor)
    dtype: torch.dtype | None


def later_layout(
    param: ShardedParam, known: tuple[StateEntry, ...], found: tuple[StateEntry, ...]
) -> tuple[StateEntry, ...]:
    """A layout changed after the parameter's first step, as its owner alone sees it: a new entry, or
    one whose shape or kind changed, stays with the owner (no other rank needs to know); state kept
    in rows on every rank must keep its shape, or the rows the others hold would come back."""
    rows = {entry.key: entry for entry in known if entry.rows}
    merged = []
    for entry in found:
        if entry.key in rows:
            if entry != rows.pop(entry.key):
                break
            merged.append(entry)
        else:
            merged.append(entry._replace(rows=False))
    else:
        if not rows:
            return tuple(merged)
    raise RuntimeError(
        f"fsdp_custom: the optimizer changed its state of {param.fqn!r} after its first step in a way placing it "
        f"whole cannot carry (state of the parameter's shape kept in rows: {sorted(e.key for e in known if e.rows)}; "
        f"now: {[(e.key, e.shape) for e in found]}). Its measurement did not reach this step: declare it "
        "elementwise if it is, or train it with sharding_strategy='NO_SHARD'"
    )


def entry_at_rest(param: ShardedParam, key: str, value: Any, rows: bool | None = None) -> StateEntry:
    """The layout entry of a state value as a rank holds it at rest: row-shaped as a loaded checkpoint
    had it (``rows``), else guessed from the shard's shape."""
    if not torch.is_tensor(value):
        return StateEntry(key, False, None, None)
    if rows is None:
        rows = value.shape == param.sharded.shape and not (param.shape == torch.Size([]) and key == "step")
    if rows:
        return StateEntry(key, True, tuple(param.shape), value.dtype)
    return StateEntry(key, False, tuple(value.shape), value.dtype)


def entry_of_whole(param: ShardedParam, key: str, value: Any) -> StateEntry:
    """The layout entry of a state value of a whole stand-in (row-shaped: the parameter's shape)."""
    if not torch.is_tensor(value):
        return StateEntry(key, False, None, None)
    rows = tuple(value.shape) == tuple(param.shape) and not (param.shape == torch.Size([]) and key == "step")
    return StateEntry(key, rows, tuple(value.shape), value.dtype)


def placed_for_step(optimizer: torch.optim.Optimizer, param: ShardedParam, key: Any, value: Any, device: Any) -> Any:
    """A state value of ``param`` as the optimizer's step on ``device`` expects it, by torch's own rule
    (``Optimizer.load_state_dict``): a ``step`` count on the host stays there (read there without a
    device wait: Adafactor's) unless its group is ``capturable`` or ``fused``; any other tensor on
    ``device``. Costs: a copy of a tensor not on ``device``."""
    if not torch.is_tensor(value):
        return value
    if key == "step" and value.device.type == "cpu":
        group = next(g for g in optimizer.param_groups if any(p is param.sharded for p in g["params"]))
        if not (group.get("capturable") or group.get("fused")):
            return value
    return value.to(device)
