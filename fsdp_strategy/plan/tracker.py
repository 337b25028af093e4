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
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
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
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._original_resize
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.track(tree_leaves(out))
        return out

    def track(self, tensors: Iterable[Any], tag: str | None = None) -> None:
        """Count the storages of ``tensors`` not counted yet (under ``tag``, default the current one)."""
        for tensor in tensors:
            storage = _storage(tensor)
            if storage is not None and id(storage) not in self._storages:
                self._add(storage, tag or self.tag)
        self._note_peak()

    def retag(self, tensors: Iterable[Any], tag: str) -> None:
        """Move the storages of ``tensors`` (counting them first if needed) to ``tag``."""
        for tensor in tensors:
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
        for tensor in tensors:
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


def _storage(tensor: Any) -> torch.UntypedStorage | None:
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided:
        return None
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # a tensor subclass without a storage of its own
        return None
