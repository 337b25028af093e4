"""The process group of a torchrun attempt, in keys no earlier attempt wrote.

[Note: one namespace per attempt]
torchrun's c10d rendezvous hands its workers the agent's own TCP store (``TORCHELASTIC_USE_AGENT_STORE``),
and that store outlives the workers: after ``--max-restarts`` starts them again, the keys the failed
attempt's process group wrote (its ranks' addresses, its barrier counters) are still there, and
``init_process_group`` reads them: a restarted rank connects to a dead peer's address (``Gloo
connectFullMesh failed ... Connection refused``) or waits for a count that never comes (pytorch
#135712, #167288). Nothing in a worker's environment names the attempt (``TORCHELASTIC_RESTART_COUNT``
differs between nodes once one joins late), so the ranks agree on one here:

1. every rank ``r > 0`` writes ``hello/<r>`` = a fresh random nonce and waits for ``reply/<nonce>``;
2. rank 0 draws a fresh namespace, reads every ``hello/<r>`` and writes ``reply/<nonce>`` = the
   namespace for each nonce it has not answered yet; a stale nonce (a rank of an earlier attempt)
   gets an answer nobody reads;
3. a rank that has its answer counts itself in ``<namespace>joined``; rank 0 reads the hellos again
   until all ``world - 1`` have joined, so a rank that wrote its hello after rank 0 first read it
   (it started late) is answered too.

No earlier attempt can write ``reply/<nonce>`` for a nonce drawn now, or count in a namespace drawn
now, so every rank of this attempt ends with rank 0's namespace of this attempt, whichever ranks
restarted how often. The process group is then created on ``PrefixStore(namespace, store)``: its
keys, and those of every group, watchdog and exchange made from it later, are new. Costs: three
store calls per rank, and on rank 0 one read of all hellos per 0.2 s until every rank has joined.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

POLL_SECONDS = 0.02
REREAD_SECONDS = 0.2
KEYS = "fsdp_custom/rendezvous/"


def shares_agent_store() -> bool:
    """True in a worker of torchrun's c10d rendezvous, whose TCP store outlives restarts."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The agent's store at ``host:port`` under a namespace that this attempt's ranks agreed on
    ([Note: one namespace per attempt]). Waits up to ``timeout`` for the other ranks."""
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if world_size > 1:
        deadline = time.monotonic() + timeout.total_seconds()
        where = f"the agent's store at {host}:{port}"
        namespace = _hand_out(store, world_size, deadline, where) if rank == 0 else _ask(store, rank, where)
    else:
        namespace = f"{KEYS}{uuid.uuid4().hex}/"
    return dist.PrefixStore(namespace, store)


def _ask(store: dist.Store, rank: int, where: str) -> str:
    nonce = uuid.uuid4().hex
    store.set(f"{KEYS}hello/{rank}", nonce)
    try:
        namespace = store.get(f"{KEYS}reply/{nonce}").decode()
    except dist.DistStoreError as error:
        raise TimeoutError(
            f"fsdp_custom: rank {rank} waited for rank 0 to name this attempt's process group on {where} "
            f"and got no answer ({error}); rank 0 did not start, or died before the process group existed"
        ) from error
    store.add(f"{namespace}joined", 1)
    return namespace


def _hand_out(store: dist.Store, world_size: int, deadline: float, where: str) -> str:
    namespace = f"{KEYS}{uuid.uuid4().hex}/"
    hellos = [f"{KEYS}hello/{rank}" for rank in range(1, world_size)]
    answered: set[str] = set()
    while True:
        try:  # the first read waits for every rank's hello (a stale one counts); later reads do not wait
            nonces = [nonce.decode() for nonce in store.multi_get(hellos)]
        except dist.DistStoreError as error:
            _give_up(store, namespace, hellos, where, error)
        fresh = [nonce for nonce in nonces if nonce not in answered]
        if fresh:
            store.multi_set([f"{KEYS}reply/{nonce}" for nonce in fresh], [namespace] * len(fresh))
            answered.update(fresh)
        reread = time.monotonic() + REREAD_SECONDS
        while time.monotonic() < reread:
            if store.add(f"{namespace}joined", 0) == world_size - 1:
                return namespace
            if time.monotonic() > deadline:
                _give_up(store, namespace, hellos, where, None)
            time.sleep(POLL_SECONDS)


def _give_up(store: dist.Store, namespace: str, hellos: list[str], where: str, error: Exception | None) -> NoReturn:
    missing = [key.rsplit("/", 1)[1] for key in hellos if not store.check([key])]
    raise TimeoutError(
        f"fsdp_custom: rank 0 waited for the other {len(hellos)} ranks to join this attempt's process group on "
        f"{where}; {store.add(f'{namespace}joined', 0)} joined"
        + (f", {'rank' if len(missing) == 1 else 'ranks'} {', '.join(missing)} never started" if missing else "")
    ) from error
