"""The engine's watchdog without Lightning ([Note: watchdog], [Note: order stamps]): ranks that
issue different collectives of one size stop at the first one, for every kind; a collective no
peer joins ends at ``collective_timeout``; the flight recorder stays bounded. World 3, gloo."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from models import Block, TiedLM
from torch import nn

from fsdp_strategy.checkpoint import full_state_dict, load_folder, save_folder
from fsdp_strategy.engine import CollectiveError, check_collective_timeout, shard_model, watchdog
from fsdp_strategy.engine.collectives import CommGroup, CommLedger, all_gather, all_reduce, reduce_scatter
from fsdp_strategy.engine.flight import RING_SIZE, STAMP_SLOTS


def _mismatch_body(rank: int, world: int, kind: str) -> str:
    watchdog.start(60.0)
    comm, ledger = CommGroup.of(dist.group.WORLD), CommLedger()
    unit = "blocks.1" if rank == 1 else "blocks.0"  # rank 1 is on another unit of the same size
    data = torch.full((world * (8 + STAMP_SLOTS),), float(rank))
    try:
        if kind == "all_gather":
            all_gather(data, data[: 8 + STAMP_SLOTS].clone(), comm, ledger, unit, stamped=True).wait()
        elif kind == "reduce_scatter":
            reduce_scatter(torch.empty(8 + STAMP_SLOTS), data, comm, ledger, unit, stamped=True).wait()
        else:
            all_reduce(data, comm, ledger, unit, stamped=True).wait()
    except CollectiveError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_ranks_on_different_collectives_of_one_size_stop_at_the_first(tmp_path, kind):
    messages = run_ranks(_mismatch_body, 3, tmp_path, kind, timeout=60)
    for rank, message in enumerate(messages):  # every rank stops, naming both units and where each rank was
        assert f"rank {rank} (node 0) stopped at {kind} #1 of unit" in message, message
        assert "different collective" in message
        assert "of unit 'blocks.1'" in message and "of unit 'blocks.0'" in message
    if kind == "all_gather":  # every rank sees every rank's stamp: the odd one is named
        assert "ranks [1] issued a different collective here" in messages[0]
        assert "ranks [0, 2] issued a different collective here" in messages[1]


def _timeout_body(rank: int, world: int) -> dict:
    model = shard_model(TiedLM(), auto_wrap_policy={Block}, collective_timeout=1.5)
    tokens = torch.randint(0, 37, (2, 6))
    model(tokens).sum().backward()  # one good step
    if rank == 1:
        time.sleep(60)  # stuck outside any collective: the watchdog ends this process
    start = time.monotonic()
    try:
        model(tokens)
    except CollectiveError as error:
        dump = Path(tempfile.gettempdir()) / f"fsdp_custom_flight_rank0_pid{os.getpid()}.json"
        return {"error": str(error), "seconds": time.monotonic() - start, "dump": json.loads(dump.read_text())}
    return {"error": None}


def test_a_collective_no_peer_joins_ends_at_collective_timeout(tmp_path):
    results = run_ranks(_timeout_body, 2, tmp_path, timeout=60, allow_failure=True)
    first = results[0]
    assert first["error"] is not None and 1.4 < first["seconds"] < 10
    assert "rank 0 (node 0) stopped at all_gather #" in first["error"]
    assert "collective_timeout=1.5 s" in first["error"]
    assert "rank 1 was not waiting in a collective of the engine" in first["error"]
    assert f"this rank: {tempfile.gettempdir()}/fsdp_custom_flight_rank0_pid" in first["error"]
    ring = first["dump"]["ring"]  # the whole ring, bounded, the last collective still in flight
    assert 0 < len(ring) <= RING_SIZE and ring[-1]["kind"] == "all_gather" and ring[-1]["ended"] is None
    assert [r["seq"] for r in ring] == list(range(ring[0]["seq"], ring[-1]["seq"] + 1))
    assert "exit code 1" in str(results[1])  # rank 1, asleep in Python, was ended by its watchdog


def _no_parameters_body(rank: int, world: int, root: str) -> dict:
    model = shard_model(nn.Sequential(nn.ReLU(), nn.Identity()))
    out = model(torch.randn(3, 4))
    save_folder(Path(root) / "empty", model, [], {})
    load_folder(Path(root) / "empty", model, [])
    return {"shape": tuple(out.shape), "state": full_state_dict(model, rank0_only=False)}


def test_a_model_without_parameters_runs_saves_and_loads(tmp_path):
    for result in run_ranks(_no_parameters_body, 2, tmp_path, str(tmp_path)):
        assert result == {"shape": (3, 4), "state": {}}


def test_inputs_of_another_float_dtype_are_cast_to_param_dtype():
    torch.manual_seed(0)
    model = shard_model(nn.Linear(4, 3), mixed_precision={"param_dtype": torch.bfloat16})
    x = torch.randn(2, 4, dtype=torch.float64)
    out = model(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, model(x.to(torch.bfloat16)))


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "collective_timeout=0 must be positive"),
        (-1.0, ValueError, "must be positive"),
        ("10", TypeError, "collective_timeout must be seconds.*got '10'"),
        (True, TypeError, "collective_timeout must be seconds"),
    ],
)
def test_bad_collective_timeouts_are_named(value, error, message):
    with pytest.raises(error, match=message):
        check_collective_timeout(value)
