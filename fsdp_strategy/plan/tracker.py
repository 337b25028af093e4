"""LiveBytes: the bytes of every tensor storage alive in this thread, and their peak.

A ``TorchDispatchMode`` sees each operator's outputs; a storage seen for the first time is
counted until it is freed (a weak reference's callback) and follows ``UntypedStorage.resize_``
(the engine frees and re-allocates full parameters that way). Views and in-place results share
a storage and are counted once. It works on real tensors (what a run measures) and on fake ones
(what a plan counts), so the two are counted by one rule.

Each storage carries a tag from when it was first seen (``tag``: "activations" unless the
caller says otherwise, e.g. "optimizer state" during ``optimizer.step()``); ``retag`` moves
known storages to another tag. ``host_tags`` are left out of the peak: with CPU offload the
shards and the optimizer state live in host memory. At each new peak a ``Peak`` keeps the bytes
per tag and what the ``describe`` callback says about the moment; with a ``moment`` callback
(cheap: it runs at every operator) the peak is kept per moment it names (``peaks``), and ``peak``
is the highest of them.

Costs: one Python call per operator and a dict copy per new peak; tensors made in other threads
or before ``__enter__`` are counted only if given to ``track``.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

ACTIVATIONS = "activations"


@dataclass
class Peak:
    """The counts at the highest total seen (``bytes``: what counts toward the peak)."""

    bytes: int = 0
    by_tag: dict[str, int] = field(default_factory=dict)
    moment: dict[str, Any] = field(default_factory=dict)
    order: int = 0  # when it was reached (among all peaks of a tracker): the earliest wins a tie


class LiveBytes(TorchDispatchMode):
    """Live storage bytes per tag in this thread, and their peak (see the module docstring)."""

    def __init__(
        self,
        describe: Callable[[], dict[str, Any]] | None = None,
        host_tags: Iterable[str] = (),
        moment: Callable[[], Hashable] | None = None,
    ) -> None:
        super().__init__()
        self.tag = ACTIVATIONS
        self.by_tag: dict[str, int] = defaultdict(int)
        self.peaks: dict[Hashable, Peak] = {}  # moment -> the highest bytes seen at it
        self._describe = describe or dict
        self._moment = moment or (lambda: None)
        self._reached = 0
        self._host_tags = frozenset(host_tags)
        self._storages: dict[int, list] = {}  # id(storage) -> [weak reference, bytes, tag]
        self._original_resize: Any = None

    @property
    def peak(self) -> Peak:
        """The highest of the peaks (the earliest of equal ones)."""
        return max(self.peaks.values(), key=lambda p: (p.bytes, -p.order), default=Peak())

    @property
    def current(self) -> int:
        """Bytes alive now that count toward the peak."""
        return sum(n for tag, n in self.by_tag.items() if tag not in self._host_tags)

    def __enter__(self) -> LiveBytes:
        self._original_resize = original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            self._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        SHADOWS.enter()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize
        SHADOWS.exit()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local operators, which come back here (MemTracker's rule)
        if SHADOWS.depth:
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func is WAIT_TENSOR:
            self._alias(out, args[0])
        self.track(tree_leaves(out))
        return out

    def _alias(self, out: Any, source: Any) -> None:
        """``out`` is ``source`` in a real run (a collective's result, waited for in place); fake tensors
        give it a storage of its own, which would count the result twice: the count moves to ``out``."""
        mine, theirs = _storage(out), _storage(source)
        entry = self._storages.pop(id(theirs), None) if mine is not None and theirs is not None else None
        if entry is not None and id(mine) not in self._storages:
            key = id(mine)
            self._storages[key] = [weakref.ref(mine, lambda _, key=key: self._freed(key)), entry[1], entry[2]]
        elif entry is not None:
            self._storages[id(theirs)] = entry

    def track(self, tensors: Iterable[Any], tag: str | None = None) -> None:
        """Count the storages of ``tensors`` not counted yet (under ``tag``, default the current one)."""
        for tensor in _inner(tensors):
            storage = _storage(tensor)
            if storage is not None and id(storage) not in self._storages:
                self._add(storage, tag or self.tag)
        self._note_peak()

    def retag(self, tensors: Iterable[Any], tag: str) -> None:
        """Move the storages of ``tensors`` (counting them first if needed) to ``tag``."""
        for tensor in _inner(tensors):
            storage = _storage(tensor)
            if storage is None:
                continue
            entry = self._storages.get(id(storage))
            if entry is None:
                self._add(storage, tag)
                continue
            self.by_tag[entry[2]] -= entry[1]
            self.by_tag[tag] += entry[1]
            entry[2] = tag

    def bytes_of(self, tensors: Iterable[Any]) -> int:
        """Bytes of the distinct storages of ``tensors`` (counted or not)."""
        seen: dict[int, int] = {}
        for tensor in _inner(tensors):
            storage = _storage(tensor)
            if storage is not None:
                seen[id(storage)] = storage.nbytes()
        return sum(seen.values())

    def _add(self, storage: torch.UntypedStorage, tag: str) -> None:
        key, nbytes = id(storage), storage.nbytes()
        self._storages[key] = [weakref.ref(storage, lambda _, key=key: self._freed(key)), nbytes, tag]
        self.by_tag[tag] += nbytes

    def _freed(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            self.by_tag[entry[2]] -= entry[1]

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._storages.get(id(storage))
        if entry is None:
            self._add(storage, self.tag)
        else:
            nbytes = storage.nbytes()
            self.by_tag[entry[2]] += nbytes - entry[1]
            entry[1] = nbytes
        self._note_peak()

    def _note_peak(self) -> None:
        current, moment = self.current, self._moment()
        known = self.peaks.get(moment)
        if known is None or current > known.bytes:
            self._reached += 1
            self.peaks[moment] = Peak(current, dict(self.by_tag), self._describe(), self._reached)


WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


class _Shadows:
    """Whether DTensor is propagating tensor metadata: it runs each new operator once on global-shape
    stand-ins in the current fake mode (the plan's), which no rank allocates. While a tracker is open,
    DTensor's propagation is wrapped to count its depth (``depth``: above 0 inside it)."""

    def __init__(self) -> None:
        self.depth, self._open, self._original = 0, 0, None

    def enter(self) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self._open += 1
        if self._open > 1:
            return
        self._original = original = ShardingPropagator._propagate_tensor_meta_non_cached

        def counted(propagator: Any, op_schema: Any) -> Any:
            self.depth += 1
            try:
                return original(propagator, op_schema)
            finally:
                self.depth -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = counted

    def exit(self) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self._open -= 1
        if self._open == 0:
            ShardingPropagator._propagate_tensor_meta_non_cached = self._original


SHADOWS = _Shadows()


def _inner(tensors: Iterable[Any]) -> Iterator[Any]:
    """``tensors`` with each wrapper subclass (a tensor-parallel DTensor) replaced by the tensors it
    wraps, recursively: its own storage is a stand-in of the global size, which no rank allocates; the
    local tensor is what the rank holds, and DTensor's operators create it out of this mode's sight."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            yield from _inner(getattr(tensor, name) for name in names)
        else:
            yield tensor


def _storage(tensor: Any) -> torch.UntypedStorage | None:
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
        return None
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # a tensor subclass without a storage of its own
        return None
