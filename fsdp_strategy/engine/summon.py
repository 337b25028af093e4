"""``summon_full_params``: the whole model gathered for code that runs outside ``forward()``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fsdp_strategy.engine.runtime import Scheduler


@contextmanager
def summon_all_units(scheduler: Scheduler, writeback: bool = False) -> Iterator[None]:
    """Pin and gather every unit of ``scheduler`` while inside (see ``summon_full_params``);
    with ``writeback`` copy the full parameters into the shards on exit."""
    if scheduler.running:
        raise RuntimeError("summon_full_params() is for code outside forward and backward; the model is running")
    params = scheduler.sharded_params()
    if writeback:
        lossy = [p.fqn for p in params if p.param_dtype != p.sharded.dtype]
        if lossy:
            raise ValueError(
                f"summon_full_params(writeback=True) would round the shards: parameters {lossy[:5]} are gathered "
                "in mixed_precision.param_dtype, not their own dtype. Use writeback=False, or load new "
                "weights with load_full_state_dict"
            )
    for unit in scheduler.units:
        unit.pin()
    try:
        for unit in scheduler.units:
            unit.wait_unshard()
        yield
    finally:
        for unit in scheduler.units:
            unit.unpin(writeback)
