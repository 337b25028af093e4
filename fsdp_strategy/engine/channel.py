"""The watchdog's side channel: small keys in the default process group's store.

Each rank writes its identity once, a heartbeat counter every second, and when it fails or
sees a failure, a report; the first report of the job also goes under ``abort`` (first
wins). The channel uses a connection of its own (``Store.clone()``, torch 2.8 and later) with
short timeouts, so neither a slow store nor a dead one blocks the watchdog for long, and the
store torch's own process groups use is never reconfigured. A call that fails is retried with
backoff; only a call that fails every attempt declares the store lost (its host has ended),
after which the channel raises ``StoreLost`` at once instead of calling it again.
Costs: one connection per rank; each call is one round trip to the store's host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from fsdp_strategy.engine.diagnosis import first_line

CALL_TIMEOUT = timedelta(seconds=5)
ATTEMPTS = 4  # tries of one call before the store is declared lost
BACKOFF = 0.25  # seconds before the second try; doubled before each next one

T = TypeVar("T")


class StoreLost(RuntimeError):
    """The store did not answer any attempt of a call: the process hosting it has ended."""


class StoreChannel:
    """Keys of one watchdog under ``prefix`` in ``store`` (see the module docstring)."""

    def __init__(self, store: Any, attempts: int = ATTEMPTS, backoff: float = BACKOFF) -> None:
        self._store = store
        self._attempts = attempts
        self._backoff = backoff
        self.lost: str | None = None  # why the store was declared lost; None while it answers
        self._closing = False  # the owner is stopping: no more retries

    @classmethod
    def connect(cls, store: Any, prefix: str) -> StoreChannel:
        """A channel on a connection of its own to ``store`` (the default group's), under ``prefix``."""
        return cls(dist.PrefixStore(prefix, _own_connection(store)))

    def _call(self, call: Callable[..., T], *args: Any) -> T:
        if self.lost is not None:
            raise StoreLost(self.lost)
        delay = self._backoff
        for attempt in range(self._attempts):
            try:
                return call(*args)
            except Exception as error:  # DistStoreError, DistNetworkError, RuntimeError: all mean "no answer"
                if attempt + 1 == self._attempts or self._closing or _host_gone(error):
                    self.lost = first_line(error)
                    raise StoreLost(self.lost) from error
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Retry nothing from now on (a call in flight still ends within its timeout)."""
        self._closing = True

    def set(self, key: str, value: str) -> None:
        """Write ``key``."""
        self._call(self._store.set, key, value)

    def set_first(self, key: str, value: str) -> None:
        """Write ``key`` unless it exists (the first writer wins)."""
        self._call(self._store.compare_set, key, "", value)

    def read(self, key: str) -> str | None:
        """The value of ``key``, or None if it does not exist (never waits for it)."""
        if not self._call(self._store.check, [key]):
            return None
        return self._call(self._store.get, key).decode()

    def read_ranks(self, prefix: str, world: int) -> dict[int, str]:
        """``{rank: value}`` of the keys ``prefix/<rank>`` that exist, for ranks below ``world``."""
        found = {}
        for rank in range(world):
            value = self.read(f"{prefix}/{rank}")
            if value is not None:
                found[rank] = value
        return found


_GONE = ("broken pipe", "connection reset", "connection refused", "connection closed")


def _host_gone(error: BaseException) -> bool:
    """Whether ``error`` says the store's host closed the connection: no later attempt can answer
    (and each failed attempt makes torch log a C++ trace)."""
    text = str(error).lower()
    return any(words in text for words in _GONE)


def _own_connection(store: Any) -> Any:
    """A clone of ``store`` with short timeouts; a store that cannot be cloned (a custom one) is
    used as it is, with its own timeout (never changed: torch's process groups share it)."""
    try:
        clone = store.clone()
    except (RuntimeError, AttributeError, NotImplementedError):
        return store
    clone.set_timeout(CALL_TIMEOUT)
    return clone
