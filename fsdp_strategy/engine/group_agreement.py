"""Param group values that differ between the ranks after a step: an error on every rank, never a
silent divergence; attributes that differ: a warning.

[Note: param groups agree]
An optimizer may set a param group value from the parameters it steps: pytorch-optimizer's SWATS
switches a group to SGD, with a learning rate computed from one parameter's update, at the step
where that parameter's statistic settles (step 13 on the test's MLP). On one process every parameter
is stepped in one place. Sharded, each rank steps its own rows (elementwise) or its own whole
parameters (placed whole: [Note: whole-matrix placement] in whole_matrix.py), so each rank sets
the value from other data, the ranks go on with different settings, and a checkpoint keeps rank
0's. The measurement before the first step ([Note: measure what will run] in optimizer_kinds.py)
sees this only where the branch runs in its few steps. So after every step of an optimizer that
is not one of torch's own (declared ones too), the ranks compare its param groups, and its
attributes of scalar values and tensors (private ones too) and the entries of ``optimizer.state``
under keys that are not parameters, in ``BUCKETS`` groups by name (as many on every rank):
- each rank digests each group's values but ``params`` on the host (plain values: numbers of any kind,
  numpy's scalars and small arrays, strings, enum members, dtypes, dataclasses, None and sequences,
  sets and dicts of them, by value, never by an address; a tensor by its shape and dtype; anything
  else by its type), one 62-bit number per group (mixed with its index; group i added into word
  i % ``GROUP_SLOTS``, so the words are as many on every rank whatever groups each holds, their
  number one word more), copied to the device without a host wait
  (``DeviceLayer.copy_from_host``), and hashes its small tensors (up to
  ``SMALL`` elements: a learning rate kept as a tensor, ``betas`` as a tuple of tensors, a 0-dim
  statistic) where they are, without reading them: each element's exact bits (as float64, or
  int64 for integers) mixed with its place (splitmix64's finalizer, on the device) and summed, so
  two values that differ agree only by a 64-bit collision, not by cancelling each other (a plain
  weighted sum did);
- one all-reduce MAX over the shard group of these words (two per group slot and per attribute
  bucket, the number of groups, a mark) and their negations: they agree where the maximum equals
  the minimum;
- the verdict goes to the host as a ``HostCopy`` and is read by the rule of ``LostEdits``
  ([Note: edits while gathered] in edits.py): on the CPU at once (after the step that set the
  value), on CUDA one step later (a host wait inside a step stalls the device: [Note: host and
  device] 4 in device.py), and at ``close``. Every rank reads the same agreed verdict at the same
  place. A param group that differs is an error on every rank, naming the optimizer, the group, the
  step and this rank's values (a group added on some ranks only: their number) (a param group holds
  what the update reads). Attributes that differ are a warning, once, naming the few they may be (a
  timer or a record of each rank's loss differs harmlessly; a statistic the update reads does not,
  and the warning says so): ending a healthy job
  for its bookkeeping would be worse.
A value changed between steps on some ranks only, in a way that may switch a branch of the update
([Note: measure what will run] in optimizer_kinds.py), makes only those ranks measure the optimizer
again: before measuring, each compares its groups with a mark (``before_measuring``, read at once),
which meets the other ranks' comparison after their step (same size, same place in their order of
collectives) and every rank raises, instead of the ranks waiting in two different collectives until
the collective timeout. An optimizer placed whole (whose next collective would gather its matrices)
is compared before each step too (``before_placing``), for that comparison to meet: one all-reduce
more per step, read like the one after it.
Not seen: a value every rank sets alike from what each holds (the number of elements it steps, equal
across ranks by the padding), a container attribute, and a tensor of more than ``SMALL`` elements
that keeps its shape. Costs per step of such an optimizer: a digest of its values on the host
(microseconds), about 20 elementwise ops per small tensor value (its hash), an all-reduce of 832
bytes and a copy of 26 bytes to the host.
torch's own optimizers set no group value from data and are not checked.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import numbers
import operator
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from fsdp_strategy.engine import collectives
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.device import DeviceLayer, HostCopy

SMALL = 64  # elements of a tensor value compared by value (a hyperparameter); a larger one by its shape
BUCKETS = 8  # groups of the optimizer's attributes compared apart (to name the ones that differ)
GROUP_SLOTS = 16  # words for the param groups: group i in slot i % GROUP_SLOTS (as many on every rank)
log = logging.getLogger(__name__)


class _Sent(NamedTuple):
    copy: HostCopy  # per group slot, attribute bucket, then the number of groups and the mark: whether they differ
    optimizer: str  # its class's name
    when: str  # "after its step 3", "before its step 4" (its steps counted from 1)
    groups: list[dict[str, Any]]  # this rank's param group values then, for the error
    buckets: list[dict[str, Any]]  # this rank's attributes then, in their buckets
    measuring: bool  # sent before a measurement again ([Note: param groups agree])


class GroupAgreement:
    """Compares the param group values of optimizers across the shard group after their steps
    ([Note: param groups agree]). Costs: see the note."""

    def __init__(self, comm: CommGroup, ctx: CommContext, device: torch.device) -> None:
        self._comm, self._ctx, self._device = comm, ctx, device
        self._steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its steps so far
        self._sent: deque[_Sent] = deque()
        self._said: set[tuple[str, tuple[str, ...]]] = set()  # attributes found apart, said once

    def send(self, optimizer: torch.optim.Optimizer) -> None:
        """Start the comparison of ``optimizer``'s groups after its step (every rank, at the same
        place); reads nothing. Then raises for the comparisons that are due."""
        step = self._steps[optimizer] = self._steps.get(optimizer, 0) + 1
        self._sent.append(self._compare(optimizer, f"after its step {step}", measuring=False))
        self.raise_due()

    def before_measuring(self, optimizer: torch.optim.Optimizer) -> None:
        """Before ``optimizer`` is measured again for values changed since its last step: the same
        comparison, marked, read at once (the measurement reads on the host anyway). Where only some
        ranks measure, it meets the others' comparison after their step: every rank raises."""
        self._sent.append(self._compare(optimizer, self._before_next(optimizer), measuring=True))
        self.raise_due(everything=True)

    def before_placing(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a step of ``optimizer`` placed whole that is not measured again here: the comparison
        that meets a rank's ``before_measuring`` (the other ranks' next collective would gather its
        matrices); reads nothing. Then raises for the comparisons that are due."""
        self._sent.append(self._compare(optimizer, self._before_next(optimizer), measuring=False))
        self.raise_due()

    def _before_next(self, optimizer: torch.optim.Optimizer) -> str:
        return f"before its step {self._steps.get(optimizer, 0) + 1}"

    def _compare(self, optimizer: torch.optim.Optimizer, when: str, measuring: bool) -> _Sent:
        """One all-reduce MAX, of the same size on every rank whatever each holds, of the digests and
        tensor hashes of the param groups (folded into ``GROUP_SLOTS`` words) and attribute buckets, the
        number of groups and the mark, with their negations."""
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        buckets = _attribute_buckets(optimizer)
        digests = [0] * GROUP_SLOTS + [_digest(values) for values in buckets] + [len(groups), int(measuring)]
        for index, values in enumerate(groups):
            slot = index % GROUP_SLOTS
            digests[slot] = (digests[slot] + _digest({"group": index, "values": values})) % 2**62
        rows = [digests, [0] * len(digests)]
        words = DeviceLayer.copy_from_host(torch.tensor(rows, dtype=torch.int64, device="cpu"), self._device)
        places = [(index % GROUP_SLOTS, f"[{index}]", values) for index, values in enumerate(groups)]
        places += [(GROUP_SLOTS + index, "", values) for index, values in enumerate(buckets)]
        for slot, place, values in places:  # only where a group holds small tensors: no launch otherwise
            checksum = self._checksum(values, place)
            if checksum is not None:
                words[1, slot] += checksum
        both = torch.cat([words, -words])
        collectives.all_reduce(both, self._comm, self._ctx, "param groups", op="max").wait()
        highest, lowest = both.view(2, 2, -1)
        differ = (highest != -lowest).any(dim=0)
        name = type(optimizer).__name__
        return _Sent(DeviceLayer.copy_to_host(differ), name, when, groups, buckets, measuring)

    def _checksum(self, values: dict[str, Any], place: str) -> torch.Tensor | None:
        """A hash of the small tensors among ``values`` at any depth (a learning rate kept as a tensor,
        ``betas`` as a tuple of tensors), computed where they are, without reading them: per element,
        its exact bits mixed with its place, summed with wrap-around; None where there are none. A tensor
        of more than ``SMALL`` elements counts by its shape only (the digest). ``place``: where ``values``
        are (a param group's index)."""
        total = None
        for where, value in _small_tensors(values, place):
            bits = DeviceLayer.copy_from_host(_exact_bits(value), self._device)
            places = torch.arange(bits.numel(), device=self._device, dtype=torch.int64) + _digest({"place": where})
            term = _mix(_mix(bits) + _mix(places)).sum()
            total = term if total is None else total + term
        return total

    def raise_due(self, everything: bool = False) -> None:
        """Raise for the first comparison due that found groups differing. Due: on the CPU every one
        sent; on CUDA every one but the last, which has had a step to land; ``everything``: the last
        one too, waiting for the device (outside a step only)."""
        due = len(self._sent)
        if not everything and self._sent and self._sent[-1].copy.event is not None:
            due -= 1
        for _ in range(due):
            sent = self._sent.popleft()
            differ = sent.copy.wait().tolist()  # host memory, landed: no device wait inside a step
            if differ[-2]:  # the number of groups
                self._sent.clear()
                _raise_for(sent, len(differ) - 2)
            if differ[-1]:  # the mark
                self._sent.clear()
                raise RuntimeError(_measured_apart(sent))
            if any(differ[:GROUP_SLOTS]):
                self._sent.clear()
                _raise_for(sent, differ.index(True))
            apart = differ[GROUP_SLOTS : GROUP_SLOTS + BUCKETS]
            names = sorted(name for bucket, differs in zip(sent.buckets, apart) if differs for name in bucket)
            if names and (sent.optimizer, tuple(names)) not in self._said:
                self._said.add((sent.optimizer, tuple(names)))
                if self._comm.rank == 0:
                    log.warning(_attributes_apart(sent, names))


def _raise_for(sent: _Sent, slot: int) -> None:
    """Raise for the param groups of ``slot`` (the number of groups where ``slot`` is past the slots)."""
    indices = [index for index in range(len(sent.groups)) if index % GROUP_SLOTS == slot]
    if slot >= GROUP_SLOTS or not indices:
        raise RuntimeError(
            f"fsdp_custom: {sent.optimizer} holds {len(sent.groups)} param group(s) here and another number on "
            f"other ranks ({sent.when}): a param group was added on some ranks only (add_param_group). Add it on "
            "every rank alike"
        )
    which = f"param group {indices[0]}" if len(indices) == 1 else f"one of the param groups {indices}"
    values = {k: v for k, v in sent.groups[indices[0]].items() if not torch.is_tensor(v) or v.numel() <= SMALL}
    raise RuntimeError(
        f"fsdp_custom: {sent.optimizer}'s {which} holds other values on other ranks {sent.when} "
        f"(here: {values}). Either its step set them from the parameters this rank steps, which "
        "are not every parameter when they are sharded (a branch the measurement before its first step did not "
        "reach), or code between steps set them differently on each rank (a scheduler fed each rank's own "
        "metric: log it with sync_dist=True). The ranks would go on with different settings and a checkpoint "
        "would keep rank 0's. In the first case sharding_strategy='NO_SHARD' (every rank steps whole "
        "parameters, as DDP) works with it"
    )


def _measured_apart(sent: _Sent) -> str:
    values = {k: v for k, v in sent.groups[0].items() if not torch.is_tensor(v) or v.numel() <= SMALL}
    here = "this rank measures it again" if sent.measuring else "this rank does not"
    return (
        f"fsdp_custom: {sent.optimizer}'s param groups or attributes were changed between its steps on some ranks "
        f"only (found {sent.when}): where a value that may switch a branch of its update changed, it is measured "
        f"again before it steps, and the other ranks do not measure it ({here}; group 0 here: {values}). Change "
        "param group values and attributes on every rank alike (a scheduler fed each rank's own metric: log it "
        "with sync_dist=True)"
    )


def _attributes_apart(sent: _Sent, names: list[str]) -> str:
    return (
        f"fsdp_custom: {sent.optimizer}'s attributes {names} (or one of them) hold other values on other ranks "
        f"{sent.when}. Harmless if its updates do not read them (a timer, a log of the loss); "
        "if they do (a statistic of the gradients it steps, the closure's loss, which is each rank's own), the "
        "ranks train apart: sharding_strategy='NO_SHARD' (every rank steps whole parameters, as DDP) works "
        "with such an optimizer. Said once"
    )


def _attribute_buckets(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's attributes of scalar values and tensors (private ones too), and the entries of
    ``optimizer.state`` under keys that are not parameters, in ``BUCKETS`` groups by a digest of their
    names: as many on every rank whatever each holds, and naming the few a difference may be in."""
    buckets: list[dict[str, Any]] = [{} for _ in range(BUCKETS)]
    values = {
        key: value
        for key, value in vars(optimizer).items()
        if key not in ("param_groups", "state", "defaults")
        and (torch.is_tensor(value) or value is None or isinstance(value, (bool, int, float, str)))
    }
    values.update({f"state[{key!r}]": value for key, value in optimizer.state.items() if isinstance(key, str)})
    for name, value in values.items():
        buckets[_digest({"name": name}) % BUCKETS][name] = value
    return buckets


def _digest(values: dict[str, Any]) -> int:
    """A 62-bit digest of a group's values, equal on every rank for equal values (no ``hash``: Python
    salts it per process)."""
    text = repr(_plain(values)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def _plain(value: Any) -> Any:
    """``value`` as plain data whose ``repr`` is the same in every process for equal values: no
    addresses, no set order. Numbers of any kind (numpy's, ``Fraction``, ``Decimal``), enum members,
    dtypes, devices and dataclasses by value; another object by its type only."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_plain(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted(((repr(_plain(k)), _plain(v)) for k, v in value.items()), key=operator.itemgetter(0)))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_plain(item)) for item in value)))
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if all(hasattr(value, name) for name in ("tobytes", "shape", "dtype", "size")):  # numpy's scalars and arrays
        if value.dtype.hasobject:  # its bytes are addresses
            return ("array", tuple(value.shape), _plain(value.tolist()) if value.size <= SMALL else None)
        small = value.size <= SMALL  # np.float32(0.01) by its bytes
        return ("array", tuple(value.shape), str(value.dtype), value.tobytes().hex() if small else None)
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__qualname__, value.name)
    if isinstance(value, (numbers.Number, torch.dtype, torch.device)):  # Fraction(1, 20), torch.bfloat16
        return (type(value).__qualname__, repr(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (type(value).__qualname__, tuple((f.name, _plain(getattr(value, f.name))) for f in fields))
    return ("object", type(value).__qualname__)


def _small_tensors(value: Any, place: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of 1 to ``SMALL`` elements in ``value`` (a param group's values, at any depth of
    lists, tuples and dicts), each with its place in it (``['betas'][0]``)."""
    if torch.is_tensor(value):
        if 0 < value.numel() <= SMALL:
            yield place, value
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _small_tensors(item, f"{place}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _small_tensors(item, f"{place}[{_plain(key)!r}]")


def _exact_bits(value: torch.Tensor) -> torch.Tensor:
    """``value``'s elements as int64 words that are equal only where the values are: integers (and
    bools) as themselves, floating and complex ones by the bits of their float64 parts (exact for every
    dtype up to float64: -0.0 and each NaN payload apart). On ``value``'s device; nothing is read."""
    flat = value.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_floating_point():
        return flat.to(torch.int64)
    return flat.to(torch.float64).contiguous().view(torch.int64)


_MIX = (0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64)  # splitmix64's multipliers, as int64


def _mix(words: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 words (a bijection; wrap-around multiplies, logical shifts), so
    that sums of mixed words collide by chance only, not by one value's change cancelling another's."""
    for shift, multiplier in ((30, _MIX[0]), (27, _MIX[1]), (31, None)):
        words = words ^ ((words >> shift) & ((1 << (64 - shift)) - 1))
        if multiplier is not None:
            words = words * multiplier
    return words
