"""Where a Fabric loop stands in its dataloader's epochs, as ``fabric.save`` records it and
``fabric.load`` resumes it.

[Note: a Fabric loop's data position]
Fabric's dataloader wrapper calls the sampler's ``set_epoch`` with the number of ``iter()`` calls
before that one, and the loop takes batches from the latest iteration one at a time
(``BatchCounter`` counts both). Fabric's ``save`` and ``load`` see the inner DataLoader only, so the
position lives with it:

- saved while an iteration is open (inside the ``for``, or after the loop left it by a ``break`` or
  an exception), it is that epoch and the global samples the job took of it (those a resume into
  the epoch skipped included), as torchdata's ``StatefulDataLoader`` records it; a loop that
  ``break``s out of its epochs early (a batch limit) and saves after the ``break`` resumes the rest
  of that epoch, which its uninterrupted run never sees: the resume says so;
- saved after the iteration ran to its end (the ``for`` is over), or before any ``iter()``, it is
  the next epoch from its start.

A resume makes the sampler add to ``set_epoch``'s number what takes the loop's next ``iter()`` to
the saved epoch, and skip what was taken of it, at any world size: the next ``iter()`` after
``fabric.load``, so a batch peeked at between the load and the loop takes the resumed epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from fsdp_strategy.data import DataPosition, make_resumable

RUNNING, FINISHED, LEFT = "running", "finished", "left"  # how the latest iteration stands


class BatchCounter:
    """Counts what a loop takes from one DataLoader: its ``iter()`` calls, the batches the latest
    iteration handed to the loop, and how that iteration stands: ``RUNNING``, ``FINISHED`` (its last
    batch was taken: the loop's ``for`` is over) or ``LEFT`` (closed before its end: a ``break``, or
    an exception out of the loop); ``None`` before the first ``iter()`` and after a resume.
    Costs: one generator frame per batch."""

    def __init__(self) -> None:
        self.iterations = 0
        self.taken = 0
        self.state: str | None = None

    def count(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` (the DataLoader's iterator) counted as the loop's latest iteration."""
        self.iterations += 1
        self.taken, self.state = 0, RUNNING
        return self._counted(batches, self.iterations)

    def _counted(self, batches: Iterator[Any], iteration: int) -> Iterator[Any]:
        finished = False
        try:
            for batch in batches:
                if self._is_latest(iteration):
                    self.taken += 1
                yield batch
            finished = True
        finally:
            if self._is_latest(iteration):
                self.state = FINISHED if finished else LEFT

    def _is_latest(self, iteration: int) -> bool:
        return iteration == self.iterations and self.state is not None

    def restart(self) -> None:
        """Forget the iterations so far (a resume): what they take is no longer counted."""
        self.taken, self.state = 0, None


_COUNTING_CLASSES: dict[type, type] = {}


def _counting_class(base: type[DataLoader]) -> type[DataLoader]:
    """``base`` whose ``__iter__`` hands its batches through the instance's ``_batch_counter``
    (one class per base; pickled as ``base``'s instance with the counter)."""
    if base not in _COUNTING_CLASSES:

        def __iter__(self: DataLoader) -> Iterator[Any]:
            batches = super(counting, self).__iter__()
            counter = self.__dict__.get("_batch_counter")
            return batches if counter is None else counter.count(batches)

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


class LoopDataPosition(DataPosition):
    """A Fabric loop's position in its dataloader ([Note: a Fabric loop's data position]).
    Costs: a few integers."""

    def __init__(self, counter: BatchCounter, position: DataPosition) -> None:
        super().__init__(position.sampler, position.batch_size, lambda: counter.taken)
        self.counter = counter
        self.resumed: dict[str, Any] | None = None  # the position loaded, until the loop's next iter()

    def loop_state(self) -> dict[str, Any]:
        """The position to save: ``epoch``, ``consumed_samples`` (global), the job's ``world_size``
        and ``batch_size``, and ``left`` where the loop had left that epoch before its end."""
        state, sampler, counter = self.state_dict(), self.sampler, self.counter
        upcoming = counter.iterations + sampler.epoch_offset  # the epoch the loop's next iter() runs
        if counter.state is None:
            resumed = self.resumed or {}
            left = bool(resumed.get("left"))
            return {**state, "epoch": upcoming, "consumed_samples": resumed.get("consumed_samples", 0), "left": left}
        if counter.state == FINISHED:
            return {**state, "epoch": upcoming, "consumed_samples": 0, "left": False}
        if sampler.skip_epoch == sampler.epoch:
            state["consumed_samples"] += sampler.skip
        state["consumed_samples"] = min(state["consumed_samples"], len(sampler.dataset))  # a short last batch
        return {**state, "left": counter.state == LEFT}

    def resume_loop(self, state: dict[str, Any]) -> None:
        """Make the loop's next ``iter()`` run ``state``'s epoch, after what it had taken of it."""
        self.sampler.epoch_offset = state["epoch"] - self.counter.iterations
        self.load_state_dict(state)
        self.counter.restart()
        self.resumed = dict(state)


def make_loop_resumable(dataloader: Any) -> tuple[Any, LoopDataPosition | None]:
    """A Fabric loop's ``dataloader`` rebuilt around a ResumableDistributedSampler and counting the
    batches its loop takes ([Note: a Fabric loop's data position]), with its position; unchanged
    (None) where it is not a DataLoader with a plain DistributedSampler."""
    loader, position = make_resumable(dataloader, lambda: 0)
    if position is None:
        return dataloader, None
    counter = BatchCounter()
    loader._batch_counter = counter
    loader.__class__ = _counting_class(type(loader))
    return loader, LoopDataPosition(counter, position)
