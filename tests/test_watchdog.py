"""The engine's watchdog without Lightning ([Note: watchdog], [Note: order stamps]): ranks that
issue different collectives of one size stop at the first one, for every kind; a collective no
peer joins ends at ``collective_timeout``; a rank outside collectives when another fails goes on
and stops at its next collective; the flight recorder stays bounded; the store channel retries
and never reconfigures the default store; the failure message's sentences (diagnosis.py) from
reports alone. World 2 and 3, gloo."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from models import Block, TiedLM
from torch import nn

from fsdp_strategy.checkpoint import full_state_dict, load_folder, save_folder
from fsdp_strategy.engine import CollectiveError, check_collective_timeout, diagnosis, shard_model, watch_limits
from fsdp_strategy.engine.channel import StoreChannel, StoreLost
from fsdp_strategy.engine.collectives import CommContext, CommGroup, all_gather, all_reduce, reduce_scatter
from fsdp_strategy.engine.diagnosis import Peer, PeerState
from fsdp_strategy.engine.flight import RING_SIZE, STAMP_SLOTS
from fsdp_strategy.engine.monitoring import CollectiveMonitor
from fsdp_strategy.engine.watchdog import Watchdog


def _mismatch_body(rank: int, world: int, kind: str, folder: str) -> str:
    comm, ctx = (
        CommGroup.of(dist.group.WORLD),
        CommContext(CollectiveMonitor(watchdog=Watchdog.start(60.0, dump_dir=folder))),
    )
    unit = "blocks.1" if rank == 1 else "blocks.0"  # rank 1 is on another unit of the same size
    data = torch.full((world * (8 + STAMP_SLOTS),), float(rank))
    try:
        if kind == "all_gather":
            all_gather(data, data[: 8 + STAMP_SLOTS].clone(), comm, ctx, unit, stamped=True).wait()
        elif kind == "reduce_scatter":
            reduce_scatter(torch.empty(8 + STAMP_SLOTS), data, comm, ctx, unit, stamped=True).wait()
        else:
            all_reduce(data, comm, ctx, unit, stamped=True).wait()
    except CollectiveError as error:
        message = str(error)
    else:
        message = "no error"
    _stay_until_all_reported(rank, world, folder)
    return message


def _stay_until_all_reported(rank: int, world: int, folder: str) -> None:
    """Keep rank 0 (the store's host) alive until every rank has read its peers' states from the store."""
    open(os.path.join(folder, f"reported{rank}"), "w").close()
    deadline = time.monotonic() + 30
    while rank == 0 and time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(folder, f"reported{peer}")) for peer in range(world)):
            return
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_ranks_on_different_collectives_of_one_size_stop_at_the_first(tmp_path, kind):
    messages = run_ranks(_mismatch_body, 3, tmp_path, kind, str(tmp_path), timeout=60)
    for rank, message in enumerate(messages):  # every rank stops, naming both units and where each rank was
        assert f"rank {rank} (node 0) stopped at {kind} #1 of unit" in message, message
        assert "different collective" in message
        assert "of unit 'blocks.1'" in message and "of unit 'blocks.0'" in message
    if kind == "all_gather":  # every rank sees every rank's stamp: the odd one is named
        assert "ranks [1] issued a different collective here" in messages[0]
        assert "ranks [0, 2] issued a different collective here" in messages[1]


def _timeout_body(rank: int, world: int, folder: str) -> dict:
    os.chdir(folder)  # the working folder: where shard_model's own watchdog writes a failing rank's ring
    model = shard_model(TiedLM(), auto_wrap_policy={Block}, collective_timeout=1.5)
    tokens = torch.randint(0, 37, (2, 6))
    model(tokens).sum().backward()  # one good step
    if rank == 1:
        time.sleep(60)  # stuck outside any collective: the watchdog ends this process
    start = time.monotonic()
    try:
        model(tokens)
    except CollectiveError as error:
        dump = Path(folder) / "fsdp_custom_flight_rank0.json"
        return {"error": str(error), "seconds": time.monotonic() - start, "dump": json.loads(dump.read_text())}
    return {"error": None}


def test_a_collective_no_peer_joins_ends_at_collective_timeout(tmp_path):
    results = run_ranks(_timeout_body, 2, tmp_path, str(tmp_path), timeout=60, allow_failure=True)
    first = results[0]
    assert first["error"] is not None and 1.4 < first["seconds"] < 10
    assert "rank 0 (node 0) stopped at all_gather #" in first["error"]
    assert "collective_timeout=1.5 s" in first["error"]
    assert "rank 1 was not waiting in a collective of the engine" in first["error"]
    assert f"this rank: {tmp_path}/fsdp_custom_flight_rank0.json" in first["error"]
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


def _limits_body(rank: int, world: int) -> dict:
    limits = {}
    for name, timeout in (("default", None), ("explicit", 1.5), ("unlimited", float("inf"))):
        dog = Watchdog.start(timeout)
        limits[name] = dog.limits
        dog.close()
    return limits


def test_the_default_collective_limit_is_the_process_groups_timeout(tmp_path):
    # dist_utils creates the group with a 90 s timeout; blocking calls get it plus a margin
    result = run_ranks(_limits_body, 2, tmp_path)[0]
    assert tuple(result["default"]) == (90.0, 90.0 + watch_limits.CONTROL_MARGIN)
    assert tuple(result["explicit"]) == (1.5, 90.0 + watch_limits.CONTROL_MARGIN)  # blocking calls keep the group's
    assert result["unlimited"].collective == float("inf")


def _outside_body(rank: int, world: int) -> dict:
    dog = Watchdog.start()  # the group's 90 s: nothing here may end a process
    comm, ctx = CommGroup.of(dist.group.WORLD), CommContext(CollectiveMonitor(watchdog=dog))
    all_reduce(torch.ones(4), comm, ctx, "warm-up").wait()
    if rank == 1:
        dog.report_exception(ValueError("a failure of rank 1's own"))
        time.sleep(8)  # stays alive while rank 0 reads its report
        return {"ended": False}
    time.sleep(3)  # outside every collective while rank 1 reports: it must go on
    start = time.monotonic()
    try:
        all_reduce(torch.ones(4), comm, ctx, "after").wait()
    except CollectiveError as error:
        return {"ended": False, "error": str(error), "seconds": time.monotonic() - start}
    return {"ended": False, "error": None}


def test_a_rank_outside_collectives_goes_on_and_its_next_collective_raises_at_once(tmp_path):
    first = run_ranks(_outside_body, 2, tmp_path, timeout=60)[0]
    assert first["error"] is not None and first["seconds"] < 1.0, first
    assert "rank 0 (node 0) stopped at all_reduce #" in first["error"] and "of unit 'after'" in first["error"]
    assert "First report: rank 1 raised ValueError: a failure of rank 1's own" in first["error"]


def _every_rank_raised_body(rank: int, world: int) -> dict:
    dog = Watchdog.start()
    comm, ctx = CommGroup.of(dist.group.WORLD), CommContext(CollectiveMonitor(watchdog=dog))
    all_reduce(torch.ones(4), comm, ctx, "warm-up").wait()
    if rank == 0:
        dog.report_exception(ValueError("the same failing step"))
    else:
        time.sleep(3)  # rank 0's report is read by now
        dog.report_exception(ValueError("the same failing step"))
    try:  # what every rank's on_exception does together: save_on_exception's collectives
        all_reduce(torch.ones(4), comm, ctx, "on_exception").wait()
    except CollectiveError as error:
        return {"error": str(error)}
    return {"error": None, "stopped": dog.abort is not None if rank == 1 else None}


def test_ranks_that_all_raised_run_their_exception_handlers_collectives_together(tmp_path):
    """Every rank raised (the same failing step): another rank's report does not stop this rank's
    collectives in ``on_exception`` (a checkpoint ``save_on_exception`` writes); it did, by a race."""
    results = run_ranks(_every_rank_raised_body, 2, tmp_path, timeout=60)
    assert [result["error"] for result in results] == [None, None], results
    assert results[1]["stopped"], results  # rank 1 had read rank 0's report before its collective


def _stopped_peer_body(rank: int, world: int) -> str:
    comm, ctx = CommGroup.of(dist.group.WORLD), CommContext(CollectiveMonitor(watchdog=Watchdog.start(2.0)))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent until rank 0 continues it
        return "continued"
    try:
        all_reduce(torch.ones(4), comm, ctx, "waits").wait()
    except CollectiveError as error:
        return str(error)
    finally:
        os.kill(pids[1], signal.SIGCONT)
    return "no error"


def test_a_live_rank_that_sends_no_heartbeat_is_not_responding_not_lost(tmp_path):
    message = run_ranks(_stopped_peer_body, 2, tmp_path, timeout=60, allow_failure=True)[0]
    assert "collective_timeout=2 s" in message, message
    assert "NOT RESPONDING, its process is alive but sent no heartbeat" in message
    assert "LOST" not in message


class FlakyStore:
    """A real store whose first ``failures`` calls fail, as a store does while its host restarts."""

    def __init__(self, failures: int, error: str = "Broken pipe") -> None:
        self.store = dist.HashStore()
        self.failures, self.error = failures, error
        self.calls = 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def call(*args):
            self.calls += 1
            if self.calls <= self.failures:
                raise RuntimeError(self.error)
            return method(*args)

        return call


def test_store_calls_retry_with_backoff_before_the_store_is_declared_lost():
    flaky = FlakyStore(failures=3, error="Wait timeout")
    channel = StoreChannel(flaky, attempts=4, backoff=0.01)
    channel.set("beat/0", "1")  # the fourth attempt answers
    assert channel.read("beat/0") == "1" and channel.lost is None
    slow = FlakyStore(failures=100, error="Wait timeout")
    channel = StoreChannel(slow, attempts=4, backoff=0.01)
    with pytest.raises(StoreLost, match="Wait timeout"):
        channel.set("beat/0", "1")
    assert slow.calls == 4  # every attempt, then lost
    gone = FlakyStore(failures=100)
    channel = StoreChannel(gone, attempts=4, backoff=0.01)
    with pytest.raises(StoreLost, match="Broken pipe"):
        channel.set("beat/0", "1")
    with pytest.raises(StoreLost):  # declared lost: not called again
        channel.read("beat/0")
    assert gone.calls == 1  # a closed connection is not retried: its host has ended


def test_the_channel_never_changes_the_default_stores_timeout():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=77))
    channel = StoreChannel.connect(store, "fsdp_custom/test")
    channel.set("peer/0", "{}")
    assert store.timeout == timedelta(seconds=77)
    assert dist.PrefixStore("fsdp_custom/test", store).get("peer/0") == b"{}"  # the same store, its own connection


MINE = {"seq": 40, "kind": "all_gather", "unit": "blocks.1", "step": 3, "iteration": 4}


def _report(kind: str, seq: int, unit: str = "blocks.1", waiting: bool = True) -> dict:
    latest = {"seq": seq, "kind": "all_gather", "unit": unit, "step": 3, "iteration": 4}
    return {"reason": f"rank 1 {kind} here", "kind": kind, "waiting": waiting, "latest": latest}


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        (Peer(1, None, PeerState.GONE), "rank 1 (node ?, host ?, pid ?): LOST, its process has exited"),
        (Peer(1, None, PeerState.GONE), "gloo's \"Received data size doesn't match\" there means the ranks issued"),
        (
            Peer(1, {"node": 1, "host": "b", "pid": 7}, PeerState.SILENT),
            "rank 1 (node 1, host b, pid 7): NOT RESPONDING, no heartbeat for 5 s and no report",
        ),
        (Peer(1, None, PeerState.SILENT_ALIVE), "NOT RESPONDING, its process is alive but sent no heartbeat for 5 s"),
        (Peer(1, None, PeerState.ALIVE), "alive, sent no report"),
        (
            Peer(1, None, PeerState.REPORTED, _report("failed", 38)),
            "waiting for all_gather #38 of unit 'blocks.1' (step 3, iteration 4), BEHIND by 2",
        ),
        (Peer(1, None, PeerState.REPORTED, _report("failed", 41)), "ahead by 1"),
        (
            Peer(1, None, PeerState.REPORTED, _report("failed", 40, "blocks.0")),
            "a DIFFERENT collective at the same place",
        ),
        (
            Peer(1, None, PeerState.REPORTED, _report("raised", 40, waiting=False)),
            "last issued all_gather #40 of unit 'blocks.1' (step 3, iteration 4); rank 1 raised here",
        ),
    ],
)
def test_each_peer_state_has_its_sentence(peer, expected):
    assert expected in diagnosis.peer_line(peer, MINE, silence=5.0)


def test_a_two_dimensional_run_names_each_rank_by_its_place():
    peer = Peer(3, {"node": 0, "host": "b", "pid": 7}, PeerState.GONE)
    line = diagnosis.peer_line(peer, MINE, silence=5.0, layout=(2, 2))
    assert line.startswith("rank 3 (data 1, tensor 1; node 0, host b, pid 7): LOST"), line
    assert diagnosis.peers_message(2, 0, [line], [], (2, 2)).startswith(
        "fsdp_custom: rank 2 (data 1, tensor 0; node 0)"
    )
    assert diagnosis.coordinates(5, (2, 4)) == "data 1, tensor 1; " and diagnosis.coordinates(5, None) == ""


def test_a_sigterm_while_a_report_is_written_is_handled_after_it():
    # torchrun's agent sends SIGTERM when a rank dies; Lightning's handler then runs a collective on
    # the failed group, which raised out of the report being written (it was lost)
    from fsdp_strategy.engine.reports import signals_deferred

    handled: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: handled.append("handler"))
    try:
        with signals_deferred((signal.SIGTERM,)):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            handled.append("report written")
        assert handled == ["report written", "handler"]  # once, after, by the handler that was in place
        assert signal.getsignal(signal.SIGTERM) is not previous and callable(signal.getsignal(signal.SIGTERM))
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_failure_message_puts_the_headline_and_first_report_before_the_peers():
    message = diagnosis.failure_message("headline", "rank 1 raised X", ["peer line"], ["dump line"])
    assert message == "headline\n  First report: rank 1 raised X\n  peer line\n  dump line"
    assert "First report" not in diagnosis.failure_message("same", "same", [], [])
    line = diagnosis.store_unreachable_line("StoreLost: Broken pipe")
    assert line.startswith("the store is unreachable (StoreLost: Broken pipe)") and "torchrun agent" in line


def test_peer_liveness_decides_from_heartbeats_and_this_ranks_clock_alone():
    """The watchdog thread's decision, without a store, a thread or a process: a peer on another
    host whose heartbeat stops moving is lost after ``silence`` seconds of this rank's clock; one on
    this host only when its process exits (a live process that is slow is not lost); reads are paced."""
    liveness = diagnosis.PeerLiveness("hostA", silence=60.0, every=2.0)
    hosts = {0: "hostA", 1: "hostB", 2: "hostA"}
    assert liveness.due(100.0) and not liveness.due(101.0) and liveness.due(102.0)
    assert liveness.lost(set(), {0: "5", 1: "7", 2: "3"}, hosts, now=100.0) is None
    assert liveness.lost(set(), {0: "6", 1: "7", 2: "3"}, hosts, now=159.0) is None  # 59 s of silence
    told = liveness.lost(set(), {0: "7", 1: "7", 2: "3"}, hosts, now=160.5)
    assert told == "rank 1 sent no heartbeat for 60 s (its process or host is down?)"
    assert liveness.lost(set(), {1: "8", 2: "3"}, hosts, now=161.0) is None  # it beat again; rank 2 is local
    assert liveness.lost({2}, {}, hosts, now=162.0) == "rank 2 LOST, its process has exited"
    liveness.forget()  # not waiting any more: silence is measured afresh
    assert liveness.lost(set(), {1: "8"}, hosts, now=500.0) is None
