"""A fake process group of any size in this one process: what a memory plan runs its engine on.

``fake_world(world_size)`` initializes torch's "fake" backend as the default group (rank 0 of
``world_size``): every collective returns at once without moving data, so the engine builds,
schedules and issues exactly what it would on that many ranks. Costs: nothing per collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """Rank 0 of a fake default process group of ``world_size`` ranks, destroyed on exit.

    Refused where a process group exists already: torch keeps one default group per process,
    and the plan must not touch a real job's (plan before ``init_process_group``, or in a process
    of its own)."""
    if dist.is_initialized():
        raise RuntimeError(
            "fsdp_strategy.plan() runs the engine on a fake process group of the requested size, and this "
            f"process already has a process group ({dist.get_backend()}, {dist.get_world_size()} ranks). Plan "
            "before the process group is created (e.g. before Trainer.fit or fabric.launch) or in a process "
            "of its own (the fsdp-plan command)"
        )
    from torch.testing._internal.distributed import fake_pg  # noqa: F401 - registers the "fake" backend

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_fake_meshes()


def _forget_fake_meshes() -> None:
    """Clear DTensor's caches of sharding and redistribution plans: they key a mesh by its layout, not
    its process groups, so a plan cached in the fake world would send a later real job's tensor-parallel
    collectives (the same mesh shape) to the fake world's groups, which are gone ("Could not resolve
    the process group"). Costs: the next DTensor operators plan again."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()
