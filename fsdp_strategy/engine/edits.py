"""Edits while gathered: changes user code or an optimizer makes to a unit's full parameters are
kept in its shards, exactly or with an error.

[Note: edits while gathered]
While a unit is gathered, code may change its full parameters: ``training_step`` runs inside the
root's forward (a WGAN's ``p.data.clamp_()``, an EMA or momentum encoder updated in place or by
``p.data = ...``), and an optimizer may step inside it (manual optimization, a GAN's two
optimizers). The shards are the truth, so:
- at reshard, a change is written back: each rank copies its own rows of the full parameter into
  its shard (every rank holds the same full parameter, so no communication). What is written back:
  every parameter of a unit resharded after its own forward (the module's forward may have
  changed it) and of a unit user code may have reached while gathered (the root, a unit kept
  gathered after its forward, a summoned unit with ``writeback``); of a unit resharded after its
  backward, which only autograd ran on since its gather, only the parameters with a visible trace
  (version counter, replaced ``.data``): in a steady-state step, none;
- where the full parameter is in a lower ``param_dtype`` than its shard, a change cannot be kept
  exactly, so nothing is copied and the rows are compared instead. A difference is an error naming
  the parameters, but it is never read inside a step (a host read stalls a GPU: [Note: host and
  device] 4 in device.py): the flags of a step go to the host ``non_blocking`` at the end of its
  backward (``LostEdits``), with every rank's verdict combined, and are read at the end of that
  backward on the CPU and of the next one on CUDA (a step later: landed by then), on every rank
  alike; after an iteration without a backward (evaluation) at the next iteration's start, each
  rank its own verdict (ranks may run different numbers of such iterations: a rank that raises
  is reported to the others by the watchdog); ``Scheduler.close(agree=True)`` (the strategies'
  teardown, every rank) combines and reads the last ones. The shards keep the value from before the change meanwhile;
- an optimizer step on the shards of a gathered unit (the Scheduler's optimizer hooks) first
  writes back, then, after the step, gathers the unit again (``refresh``), so the next use of the
  weights sees the stepped ones. The stepped full parameters get a new version, so a graph that
  saved the old ones is refused by autograd, as it is for any in-place update without sharding.
Costs per step: a copy of 1/N of each unit resharded after its forward (in a lower
``param_dtype``, a comparison of those rows, one stack of the flags and a copy of a few bytes to
the host); two attribute reads per parameter of a unit resharded after its backward; one
all-gather of the unit per optimizer step taken while it is gathered.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, NoReturn

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.device import DeviceLayer, HostCopy
from fsdp_strategy.engine.param import ShardedParam


class LostEditCheck(NamedTuple):
    """A change of a full parameter in a lower dtype than its shard, maybe lost ([Note: edits while gathered])."""

    unit: str
    fqn: str
    param_dtype: torch.dtype  # the gathered copy's dtype
    shard_dtype: torch.dtype
    lost: torch.Tensor  # 0-dim bool on the device: the change cannot be kept exactly


class LostEdits:
    """The checks of changes a lower ``param_dtype`` may have lost, reported on every rank alike
    without a host wait inside a step ([Note: edits while gathered], [Note: host and device] 4).

    Units add their checks when they reshard. ``send`` stacks the pending flags, prepends whether
    any rank found a lost change (one all-reduce MAX of one element over the shard and replicate
    groups, issued by every rank at the same place, so that every rank raises, not only the one
    whose rows changed) and starts the copy to the host; ``raise_due`` reads the copies that are
    due, by a rule every rank follows alike (not by which copies have landed, which differs by
    rank on CUDA). Costs, only in a model with a lower ``param_dtype``: per ``send`` a stack, a 4-byte
    all-reduce (on NCCL the compute stream waits for it, the host does not) and a few bytes copied.
    """

    def __init__(self, groups: list[CommGroup], ctx: CommContext, device: torch.device) -> None:
        self._groups = [group for group in groups if group.size > 1]
        self._ctx, self._device = ctx, device
        self._pending: list[LostEditCheck] = []
        self._sent: deque[tuple[HostCopy, list[LostEditCheck]]] = deque()

    def add(self, checks: list[LostEditCheck]) -> None:
        """Keep ``checks`` until the next ``send`` (a memory plan's carry no values: dropped)."""
        self._pending += [check for check in checks if not isinstance(check.lost, FakeTensor)]

    def send(self, agree: bool = True) -> None:
        """Start the pending checks' flags on their way to the host; reads nothing. With ``agree``
        (every rank calls it at the same place) the ranks' verdicts are combined first; without,
        only this rank's pending checks are sent (teardown, where peers may be gone)."""
        local = [check.lost for check in self._pending]
        if not agree and not local:
            return
        found = torch.stack(local) if local else torch.zeros(0, dtype=torch.bool, device=self._device)
        anywhere = found.any().to(torch.int32).reshape(1)
        if isinstance(anywhere, FakeTensor):  # a memory plan computes no verdict
            self._pending = []
            return
        if agree:
            for group in self._groups:
                collectives.all_reduce(anywhere, group, self._ctx, "lost edits", op="max").wait()
        flags = torch.cat([anywhere.bool(), found])
        self._sent.append((DeviceLayer.copy_to_host(flags), self._pending))
        self._pending = []

    def raise_due(self, everything: bool = False) -> None:
        """Raise for the first sent check that found a lost change on any rank, among those due.
        Due: on the CPU every check sent (its copy is done when it returns); on CUDA every one but
        the last sent, whose copy has had a step to land (a wait for it returns at once), so that
        every rank reads the same checks at the same place, whatever its device's pace;
        ``everything``: the last one too, waiting for the device (outside a step only)."""
        due = len(self._sent)
        if not everything and self._sent and self._sent[-1][0].event is not None:
            due -= 1
        for _ in range(due):
            copy, checks = self._sent.popleft()
            anywhere, *flags = copy.wait().tolist()  # host memory, landed a step ago: no device wait
            if anywhere:
                _raise_for([check for check, lost in zip(checks, flags) if lost])

    def drop_pending(self) -> None:
        """Forget the checks not yet sent (a failed iteration: its changes are discarded anyway)."""
        self._pending = []


def _raise_for(lossy: list[LostEditCheck]) -> NoReturn:
    if not lossy:
        raise RuntimeError(
            "fsdp_custom: another rank found a change made while its parameters were gathered in a lower "
            "mixed_precision.param_dtype that their shards cannot keep exactly (its error names them). Change "
            "parameters where they are this rank's shards (in a callback's on_train_batch_end, outside the step), "
            "give the changed modules a unit of their own (auto_wrap_policy), or train in full precision"
        )
    first = lossy[0]
    names = sorted({check.fqn for check in lossy if check.unit == first.unit})
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
    trace) into its shards, those of a unit's own dtype in one ``_foreach_copy_``; the checks of
    changes a lower ``param_dtype`` may have lost."""
    checks, kept, targets, rows = [], [], [], []
    try:
        for param in params:
            if not (every_param or param.visibly_edited()):
                continue
            if param.param_dtype != param.sharded.dtype:
                lost = param.lost_edit_check()  # compared, not copied
                checks.append(LostEditCheck(unit, param.fqn, param.param_dtype, param.sharded.dtype, lost))
                continue
            target, own_rows = param.rows_to_keep()
            kept.append(param.sharded)
            targets.append(target)
            rows.append(own_rows)
    finally:  # also when a later parameter's new ``.data`` is refused: the ones before it are kept
        if targets:  # mostly the same values: not a change autograd should see
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(kept)):
                torch._foreach_copy_(targets, rows)
    return checks
