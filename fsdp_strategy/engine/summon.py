"""``summon_full_params``: the whole model gathered for code that runs outside ``forward()``."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from fsdp_strategy.engine.param import ShardedParam
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
                f"summon_full_params(writeback=True) would round the shards: parameters {_names(lossy)} are gathered "
                "in mixed_precision.param_dtype, not their own dtype. Use writeback=False, or load new "
                "weights with load_full_state_dict"
            )
    for unit in scheduler.units:
        unit.pin()
    versions: list[tuple[ShardedParam, int]] = []
    try:
        for unit in scheduler.units:
            unit.wait_unshard()
        versions = [(p, p.unsharded._version) for p in params]
        yield
    finally:
        edited = [p for p, version in versions if p.unsharded._version != version]
        try:
            if writeback:  # every unit's first: a full parameter may hold another unit's storage (an EMA swap)
                for unit in scheduler.units:
                    unit.keep_edits(every_param=True)
        finally:  # also when one is refused: no unit stays pinned
            for unit in scheduler.units:
                unit.unpin(keep_edits=False)
    if edited and not writeback:
        _warn_not_written_back(edited)


def _warn_not_written_back(edited: list[ShardedParam]) -> None:
    """[Note: summon without writeback] As FSDP1's ``writeback=False``: a change of a full parameter
    is dropped with it where the parameter is sharded over several ranks, and stays where one rank
    holds it whole (its full parameter is its shard). FSDP1's default writes back; ours does not (a
    lower ``param_dtype`` could not keep the change), so a change seen through the version counter
    is named, with what became of it on this rank."""
    kept = [p.fqn for p in edited if p.aliased]
    dropped = [p.fqn for p in edited if not p.aliased]
    fates = ([f"discarded on exit: {_names(dropped)}"] if dropped else []) + (
        [f"kept (one rank holds them whole, the full parameter is the shard): {_names(kept)}"] if kept else []
    )
    warnings.warn(
        f"fsdp_custom: parameters changed inside summon_full_params(model) without writeback=True are "
        f"{'; '.join(fates)}. Pass writeback=True to keep changes at any number of ranks (FSDP1's default)",
        stacklevel=3,
    )


def _names(fqns: list[str]) -> str:
    return ", ".join(fqns[:5]) + (f" and {len(fqns) - 5} more" if len(fqns) > 5 else "")
