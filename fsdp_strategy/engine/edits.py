"""Edits while gathered: changes user code or an optimizer makes to a unit's full parameters are
kept in its shards, exactly or with an error.

[Note: edits while gathered]
While a unit is gathered, code may change its full parameters: ``training_step`` runs inside the
root's forward (a WGAN's ``p.data.clamp_()``, an EMA or momentum encoder updated in place or by
``p.data = ...``), and an optimizer may step inside it (manual optimization, a GAN's two
optimizers). The shards are the truth, so:
- at reshard, a change is written back: each rank copies its own rows of the full parameter into
  its shard (every rank holds the same full parameter, so no communication). Units that user code
  may have reached while gathered (the root, a unit kept gathered after its forward, a summoned
  unit with ``writeback``) write back every parameter; other units only those with a visible
  trace (version counter, replaced ``.data``). Where the full parameter is in a lower
  ``param_dtype`` than its shard, a change cannot be kept exactly: that is an error naming it;
- an optimizer step on the shards of a gathered unit (the Scheduler's optimizer hooks) first
  writes back, then, after the step, gathers the unit again (``refresh``), so the next use of the
  weights sees the stepped ones. The stepped full parameters get a new version, so a graph that
  saved the old ones is refused by autograd, as it is for any in-place update without sharding.
Costs: a copy of 1/N of the unit at each reshard of such a unit (a comparison and a device sync
with a lower ``param_dtype``); one all-gather of the unit per optimizer step taken while it is
gathered.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fsdp_strategy.engine.param import ShardedParam


class LostEditCheck(NamedTuple):
    """A change of a full parameter in a lower dtype than its shard, maybe lost ([Note: edits while gathered])."""

    unit: str
    fqn: str
    param_dtype: torch.dtype  # the gathered copy's dtype
    shard_dtype: torch.dtype
    lost: torch.Tensor  # 0-dim bool on the device: the change cannot be kept exactly


def raise_for_lost_edits(checks: list[LostEditCheck]) -> None:
    """Raise for the changes that could not be kept (one device sync for all of them, if any)."""
    if not checks or isinstance(checks[0].lost, FakeTensor):  # a memory plan carries no values ([Note: memory plan])
        return
    flags = torch.stack([check.lost for check in checks]).tolist()
    lossy = [check for check, lost in zip(checks, flags) if lost]
    if not lossy:
        return
    first = lossy[0]
    names = sorted({check.fqn for check in lossy})
    dtypes = f"{str(first.param_dtype).removeprefix('torch.')}"
    shards = f"{str(first.shard_dtype).removeprefix('torch.')}"
    raise RuntimeError(
        f"fsdp_custom: parameters {names} of unit {first.unit!r} were changed while gathered in {dtypes} (in "
        "training_step, in a module's forward, or between a unit's forward and backward), and their "
        f"{shards} shards cannot keep the change exactly. Change them where the parameters are this rank's "
        "shards (in a callback's on_train_batch_end, outside the step), give the changed modules a unit of "
        "their own (auto_wrap_policy), or train in full precision"
    )


def keep_full_edits(unit: str, params: list[ShardedParam], every_param: bool) -> list[LostEditCheck]:
    """Write each rank's rows of the changed full parameters (every one, or those with a visible
    trace) into its shards; the checks of changes a lower ``param_dtype`` may have lost."""
    checks = []
    for param in params:
        if every_param or param.visibly_edited():
            lost = param.keep_full_edits()
            if lost is not None:
                checks.append(LostEditCheck(unit, param.fqn, param.param_dtype, param.sharded.dtype, lost))
    return checks
