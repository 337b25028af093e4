"""Profiler ranges for the engine's phases, so a ``torch.profiler`` trace shows where a step goes.

Every hook and every copy or wait the engine issues runs inside ``span(name)``: a range named
``fsdp_custom::<name>`` in the trace (like FSDP2's ``FSDP::...`` ranges). Names:

- hooks: ``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``,
  ``end_of_backward``, ``before_optimizer_step``, ``after_optimizer_step``; everything below runs
  inside one of them;
- ``reduce``: a unit's turn to reduce (its reduce-scatter issued, the one before it finished),
  inside ``post_backward`` or ``end_of_backward``;
- copies: ``gather_copy_in`` (shards into the flat send buffer), ``gather_copy_out`` (gathered
  rows into the full parameters), ``reduce_copy_in`` (full gradients into the flat reduce
  buffer), ``reduce_apply`` (divide and add the reduced shard into ``sharded.grad``);
- waits: ``wait_all_gather``, ``wait_reduce_scatter``, ``wait_all_reduce`` (the host blocked on
  a collective; on NCCL only a stream wait is issued, so these are near zero).

``benchmarks/profile_step.py`` turns the ranges into a per-step breakdown under ``torch.profiler``;
``host_times()`` sums the same ranges' wall time without a profiler (``benchmarks/unit_cost.py``).
Costs: two flag reads per range when nobody records; a profiler event (or two clock reads) per
range when someone does.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

import torch
from torch.autograd import profiler

PREFIX = "fsdp_custom::"
_NOTHING = nullcontext()
F = TypeVar("F", bound=Callable[..., Any])
_host_seconds: defaultdict[str, float] | None = None  # while host_times() records: range name -> seconds


class _Clocked:
    """Adds the wall time of its body to ``_host_seconds[name]``."""

    __slots__ = ("name", "start")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if _host_seconds is not None:
            _host_seconds[self.name] += time.perf_counter() - self.start


def span(name: str) -> AbstractContextManager:
    """A profiler range ``fsdp_custom::<name>`` while a profiler records, a clocked range while
    ``host_times()`` records; otherwise nothing."""
    if _host_seconds is not None:
        return _Clocked(name)
    if profiler._is_profiler_enabled:
        return torch.profiler.record_function(PREFIX + name)
    return _NOTHING


@contextmanager
def host_times() -> Iterator[dict[str, float]]:
    """Sum the wall seconds spent in each engine range (inclusive: a copy inside a hook counts in
    both) while the block runs, in this process; the yielded dict fills as ranges close. Costs: two
    clock reads per range; no profiler, so the figures are the engine's own host time."""
    global _host_seconds
    previous, _host_seconds = _host_seconds, defaultdict(float)
    try:
        yield _host_seconds
    finally:
        _host_seconds = previous


def traced(name: str) -> Callable[[F], F]:
    """Run the decorated function inside ``span(name)``."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def in_span(*args: Any, **kwargs: Any) -> Any:
            with span(name):
                return function(*args, **kwargs)

        return in_span  # type: ignore[return-value]

    return decorate
