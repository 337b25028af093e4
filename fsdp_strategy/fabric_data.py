"""Where a Fabric loop stands in its dataloader's epochs, as ``fabric.save`` records it and
``fabric.load`` resumes it.

[Note: a Fabric loop's data position]
Fabric's dataloader wrapper gives the sampler the number of ``iter()`` calls before each one as its
epoch; the loader's own ``__iter__`` does the same here (so a loader iterated without the wrapper, or
one whose sampler the loop sets itself, runs the same epochs), and counts what each iteration hands
to the loop. Fabric's ``save`` and ``load`` see the inner DataLoader only, so the position lives with
it. Saved, it is the epoch of the loop's current iteration (the open one, else the one closed last: a
batch peeked at with ``next(iter(loader))`` inside the ``for`` is not the loop's; one peeked at
between epochs reads as an iteration left after one batch) and the global samples the job took of it
(those a resume into the epoch skipped included), with the epoch the ``iter()`` after it runs:

- an iteration still open (inside the ``for``; also at its last batch: the resumed ``for`` then ends
  at once, as it would have) resumes exactly there;
- one that ran to its end, or was closed having handed out all its batches (``zip`` of two loaders,
  ``islice``), is over: the position is the next epoch from its start;
- one closed before its end (a ``break``, an exception out of the loop) resumes the rest of that
  epoch, as torchdata's ``StatefulDataLoader`` does, and the load warns, naming the epoch a loop that
  goes on after a ``break`` would have started instead. An iterator the loop keeps in a variable
  stays open after a ``break``: it reads as a save inside the ``for``.

A resume makes the loop's next ``iter()`` run the saved epoch, skipping what was taken of it (at any
world size), and the ones after continue the saved count; a batch peeked at between
``fabric.load`` and the loop is that resumed iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from fsdp_strategy.data import DataPosition, make_resumable

RUNNING, FINISHED, LEFT = "running", "finished", "left"  # how an iteration stands


@dataclass
class _Iteration:
    """One ``iter()`` of the loader: its epoch, what a resume made it skip, its batches for this rank,
    those handed to the loop, and how it stands."""

    epoch: int
    skipped: int
    batches: int
    resumes: int  # the loader's resumes before it: one begun before the latest resume no longer counts
    taken: int = 0
    state: str = RUNNING
    touched: int = 0  # when it began, last handed out a batch or closed (the loader's tick)


class LoopDataPosition(DataPosition):
    """A Fabric loop's position in its dataloader ([Note: a Fabric loop's data position]).
    Costs: a few integers, and one generator frame per batch."""

    def __init__(self, position: DataPosition) -> None:
        super().__init__(position.sampler, position.batch_size, position.drop_last)
        self.iterations = 0  # iter() calls on the loader
        self.epoch_offset = 0  # what takes the count of iter() calls to the epoch (a resume sets it)
        self._open: list[_Iteration] = []  # iterations not closed yet, oldest first
        self._closed: _Iteration | None = None  # the iteration closed last
        self._resume: dict[str, Any] | None = None  # loaded, for the next iter()
        self._resumes = 0
        self._tick = 0

    def iterate(self, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """The loader's ``__iter__``: set the epoch (the resumed one first), then count the batches
        ``start()`` (the DataLoader's own iteration) hands to the loop."""
        sampler = self.sampler
        if self._resume is not None:
            epoch, consumed = self._resume["epoch"], self._resume["consumed_samples"]
            sampler.resume_from(epoch, consumed)
            self._resume = None
        else:
            epoch = self.iterations + self.epoch_offset
        DistributedSampler.set_epoch(sampler, epoch)
        self.iterations += 1
        self._tick += 1
        record = _Iteration(
            epoch, sampler.skipped(), self.batches(sampler.skipped()), self._resumes, touched=self._tick
        )
        self._open.append(record)
        return self._counted(start(), record)

    def _counted(self, batches: Iterator[Any], record: _Iteration) -> Iterator[Any]:
        try:
            for batch in batches:
                record.taken += 1
                self._tick += 1
                record.touched = self._tick
                yield batch
            record.state = FINISHED
        finally:
            if record.state == RUNNING:  # closed: all handed out (zip, islice) is the epoch's end too
                record.state = FINISHED if record.taken >= record.batches else LEFT
            if record.resumes == self._resumes:
                self._tick += 1
                record.touched = self._tick
                self._open.remove(record)
                self._closed = record

    def loop_state(self) -> dict[str, Any]:
        """The position to save: ``epoch``, ``consumed_samples`` (global), ``next_epoch`` (what the
        ``iter()`` after it runs), ``left`` (the loop had left that epoch before its end), and the
        job's ``world_size`` and ``batch_size``."""
        job = {"world_size": self.sampler.num_replicas, "batch_size": self.batch_size}
        if self._resume is not None:  # loaded, not iterated since
            return {**self._resume, **job}
        following = self.iterations + self.epoch_offset
        current = self._current()
        if current is None or current.state == FINISHED:
            return {"epoch": following, "consumed_samples": 0, "next_epoch": following + 1, "left": False, **job}
        taken = current.skipped + current.taken * self.batch_size * self.sampler.num_replicas
        consumed = min(taken, len(self.sampler.dataset))  # a short last batch
        left = current.state == LEFT
        return {"epoch": current.epoch, "consumed_samples": consumed, "next_epoch": following, "left": left, **job}

    def _current(self) -> _Iteration | None:
        """The loop's iteration: the open one that handed out a batch last, unless an iteration that
        ran to its end closed after it (an open one kept in a variable is stale then); with none
        open, the one closed last. A peek closed inside the ``for`` is not the loop's."""
        running = max(self._open, key=lambda it: it.touched, default=None)
        closed = self._closed
        if running is None or (closed is not None and closed.state == FINISHED and closed.touched > running.touched):
            return closed
        return running

    def resume_loop(self, state: dict[str, Any]) -> None:
        """Make the loop's next ``iter()`` run ``state``'s epoch, after what it had taken of it, and
        the ones after continue from ``state``'s next epoch; iterations before are no longer counted."""
        following = state.get("next_epoch", state["epoch"] + 1)
        self.epoch_offset = following - (self.iterations + 1)
        self._resume = {**state, "next_epoch": following}
        self._open, self._closed = [], None
        self._resumes += 1


_COUNTING_CLASSES: dict[type, type] = {}


def _counting_class(base: type[DataLoader]) -> type[DataLoader]:
    """``base`` whose ``__iter__`` runs through the instance's ``_data_position`` (one class per
    base; pickled as ``base``'s instance)."""
    if base not in _COUNTING_CLASSES:

        def __iter__(self: DataLoader) -> Iterator[Any]:
            position = self.__dict__.get("_data_position")
            iterate = super(counting, self).__iter__
            return iterate() if position is None else position.iterate(iterate)

        def __reduce__(self: DataLoader) -> tuple:
            return _rebuild_counting, (base, dict(self.__dict__))

        counting = type(f"Counted{base.__name__}", (base,), {"__iter__": __iter__, "__reduce__": __reduce__})
        _COUNTING_CLASSES[base] = counting
    return _COUNTING_CLASSES[base]


def _rebuild_counting(base: type[DataLoader], state: dict[str, Any]) -> DataLoader:
    loader = base.__new__(base)
    loader.__dict__.update(state)
    loader.__class__ = _counting_class(base)
    return loader


def make_loop_resumable(dataloader: Any) -> tuple[Any, LoopDataPosition | None]:
    """A Fabric loop's ``dataloader`` rebuilt around a ResumableDistributedSampler and counting the
    batches its loop takes ([Note: a Fabric loop's data position]), with its position (also its
    ``_data_position``); unchanged (None) where it is not a DataLoader with a plain DistributedSampler."""
    loader, position = make_resumable(dataloader)
    if position is None:
        return dataloader, None
    looped = LoopDataPosition(position)
    loader._data_position = looped
    loader.__class__ = _counting_class(type(loader))
    return loader, looped
