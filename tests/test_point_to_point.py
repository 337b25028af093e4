"""The engine's gloo all-gather and reduce-scatter, done point to point ([Note: point to point on
gloo]), against torch's own collectives on the same inputs, at world 2 and 3; a user's own
point-to-point messages in flight at the same time; and the ledger's copy counts against the
formula."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

from fsdp_strategy.engine import collectives, get_scheduler, shard_model
from fsdp_strategy.engine.collectives import CommContext, CommGroup
from fsdp_strategy.engine.exchange import Exchange
from fsdp_strategy.engine.flight import STAMP_SLOTS
from fsdp_strategy.engine.monitoring import CollectiveMonitor


def _inputs(rank: int, world: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    shard = torch.randn(numel, generator=generator)
    full = torch.randn(world * numel, generator=generator)
    return shard, full


def _two_models_in_either_order(rank: int, world: int, comm: CommGroup) -> bool:
    """Two engines' contexts (own thread, own tag, no observer: nothing watched, the same bytes
    moved) gather same-size tensors, issued in opposite orders on odd and even ranks: each still
    gets its own model's rows."""
    contexts = [CommContext(tag=1 << 21), CommContext(tag=1 << 22)]
    outputs = [torch.empty(world * 8) for _ in contexts]
    order = [0, 1] if rank % 2 == 0 else [1, 0]
    pending = {
        i: collectives.all_gather(outputs[i], torch.full((8,), 10.0 * i + rank), comm, contexts[i], "u") for i in order
    }
    for i in order:
        pending[i].wait()
    for ctx in contexts:
        ctx.close()
    expected = [torch.cat([torch.full((8,), 10.0 * i + r) for r in range(world)]) for i in range(2)]
    return all(torch.equal(out, want) for out, want in zip(outputs, expected))


def _collectives_body(rank: int, world: int) -> dict:
    comm = CommGroup.of(dist.group.WORLD)
    ctx = CommContext(CollectiveMonitor())
    ledger = ctx.observer.ledger
    numel = 1000 + STAMP_SLOTS
    shard, full = _inputs(rank, world, numel)
    # torch's own collectives are the oracle
    expected_gather = torch.empty(world * numel)
    dist.all_gather_into_tensor(expected_gather, shard)
    expected_reduced = torch.empty(numel)
    dist.reduce_scatter_tensor(expected_reduced, full.clone())

    gathered = torch.empty(world * numel)
    in_place = gathered.view(world, numel)[rank]
    in_place.copy_(shard)
    gather = collectives.all_gather(gathered, in_place, comm, ctx, "unit")
    reduced = torch.empty(numel)
    reduce = collectives.reduce_scatter(reduced, full.clone(), comm, ctx, "unit")
    uses_exchange = isinstance(gather._work, Exchange) and isinstance(reduce._work, Exchange)

    # a user's own messages on the same group, default tag, while the engine's are in flight
    peer = (rank + 1) % world
    mine = torch.full((numel,), float(rank))
    theirs = torch.empty(numel)
    user_send = dist.isend(mine, dst=peer)
    user_recv = dist.irecv(theirs, src=(rank - 1) % world)
    user_send.wait()
    user_recv.wait()
    gather.wait()
    reduce.wait()

    # stamped: the stamps survive the exchange and are checked (no error means they agreed)
    stamped_out = torch.empty(world * numel)
    collectives.all_gather(stamped_out, shard.clone(), comm, ctx, "stamped", stamped=True).wait()
    stamped_reduced = torch.empty(numel)
    collectives.reduce_scatter(stamped_reduced, full.clone(), comm, ctx, "stamped", stamped=True).wait()
    expected_stamped = torch.empty(numel)
    dist.reduce_scatter_tensor(expected_stamped, full.clone())
    return {
        "gather": torch.equal(gathered, expected_gather),
        "reduce_max_diff": (reduced - expected_reduced).abs().max().item(),
        "reduce_scale": expected_reduced.abs().max().item(),
        "user_message": torch.equal(theirs, torch.full((numel,), float((rank - 1) % world))),
        "stamped_gather": torch.equal(
            stamped_out.view(world, -1)[:, :-STAMP_SLOTS], expected_gather.view(world, -1)[:, :-STAMP_SLOTS]
        ),
        "stamped_reduce": (stamped_reduced[:-STAMP_SLOTS] - expected_stamped[:-STAMP_SLOTS]).abs().max().item(),
        "uses_exchange": uses_exchange,
        "exchange_thread": any(t.name == "fsdp_custom-exchange" for t in threading.enumerate()),
        "two_models": _two_models_in_either_order(rank, world, comm),
        "calls": {kind: totals.calls for kind, totals in ledger.current.items()},
    }


@pytest.mark.parametrize("world", [2, 3])
def test_point_to_point_collectives_equal_torchs_and_keep_user_messages_apart(tmp_path, world):
    for result in run_ranks(_collectives_body, world, tmp_path):
        assert result["gather"] and result["stamped_gather"]
        assert result["reduce_max_diff"] <= 1e-6 * result["reduce_scale"]
        assert result["stamped_reduce"] <= 1e-6 * result["reduce_scale"]
        assert result["user_message"]
        assert result["uses_exchange"] and result["exchange_thread"]
        assert result["two_models"]
        assert result["calls"] == {"all_gather": 2, "reduce_scatter": 2}


def _copies_body(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5))
    random_state = torch.get_rng_state()
    shard_model(model, auto_wrap_policy={nn.Linear}, check_collective_order=False)
    assert torch.equal(torch.get_rng_state(), random_state)  # agreeing on the exchange tag draws from no RNG of torch
    ledger = get_scheduler(model).ledger
    ledger.start_step()
    model(torch.randn(4, 6)).sum().backward()
    ledger.start_step()
    units = get_scheduler(model).units
    return {"copied": ledger.last_step_copied, "units": [[tuple(p.shape) for p in u.params] for u in units]}


def test_ledger_counts_the_bytes_copied_outside_collectives(tmp_path):
    world = 2
    result = run_ranks(_copies_body, world, tmp_path)[0]
    shapes = [shape for unit in result["units"] for shape in unit]
    chunk = [(-(-shape[0] // world)) * (shape[1] if len(shape) > 1 else 1) for shape in shapes]
    shard_bytes = 4 * sum(chunk)
    full_bytes = 4 * world * sum(chunk)
    # the two Linear units are gathered in forward and again in backward; the root has no parameters
    assert result["copied"] == {
        "gather_copy_in": 2 * shard_bytes,
        "gather_copy_out": 2 * full_bytes,
        "reduce_copy_in": full_bytes,
    }
