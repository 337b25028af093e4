"""Profiler ranges for the engine's phases, so a ``torch.profiler`` trace shows where a step goes.

Every hook and every copy or wait the engine issues runs inside ``span(name)``: a range named
``fsdp_custom::<name>`` in the trace (like FSDP2's ``FSDP::...`` ranges). Names:

- hooks: ``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``,
  ``end_of_backward``; everything below runs inside one of them;
- copies: ``gather_copy_in`` (shards into the flat send buffer), ``gather_copy_out`` (gathered
  rows into the full parameters), ``reduce_copy_in`` (full gradients into the flat reduce
  buffer), ``reduce_apply`` (divide and add the reduced shard into ``sharded.grad``);
- waits: ``wait_all_gather``, ``wait_reduce_scatter``, ``wait_all_reduce`` (the host blocked on
  a collective; on NCCL only a stream wait is issued, so these are near zero).

``benchmarks/compare.py --profile`` turns the ranges into a per-step breakdown.
Costs: one flag read per range when no profiler records; a profiler event per range when one does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from torch.autograd import profiler

PREFIX = "fsdp_custom::"
_NOTHING = nullcontext()
F = TypeVar("F", bound=Callable[..., Any])


def span(name: str) -> AbstractContextManager:
    """A profiler range ``fsdp_custom::<name>`` while a profiler records; otherwise nothing."""
    if profiler._is_profiler_enabled:
        return torch.profiler.record_function(PREFIX + name)
    return _NOTHING


def traced(name: str) -> Callable[[F], F]:
    """Run the decorated function inside ``span(name)``."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def in_span(*args: Any, **kwargs: Any) -> Any:
            with span(name):
                return function(*args, **kwargs)

        return in_span  # type: ignore[return-value]

    return decorate
