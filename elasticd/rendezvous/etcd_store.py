"""A c10d ``Store`` on etcd, one key prefix per rendezvous round.

torch's agent uses the rendezvous store during a round to assign worker ranks, publish
MASTER_ADDR/PORT and run its exit barrier. Keeping it in etcd (not in a TCPStore hosted
by one agent) means losing any node never loses the store, and giving every round its
own prefix means workers of round r+1 can never read round r's addresses.

Blocking reads (``get``/``wait``) are answered from one prefix watch per store, not by
polling. Transient etcd errors are retried until the store timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from elasticd.etcd.client import KV, EtcdClient, WatchEvent
from elasticd.retry import call_with_retry

T = TypeVar("T")


class EtcdStore(dist.Store):
    """c10d Store backed by etcd keys under ``prefix``.

    Args:
        client: the etcd client.
        prefix: key prefix of this round's store (``JobKeys.store_prefix(round)``).
        timeout_s: default timeout of blocking calls (``get``, ``wait``) and of retries.
    """

    def __init__(self, client: EtcdClient, prefix: str, timeout_s: float = 300.0) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._cache: dict[str, bytes] = {}
        self._synced = False
        self._watch = client.watch_prefix(prefix, self._on_events, self._on_resync,
                                          name=f"store:{prefix}")

    # -- watch cache ------------------------------------------------------------------
    def _on_resync(self, kvs: list[KV], revision: int) -> None:
        with self._cond:
            self._cache = {kv.key[len(self._prefix):]: kv.value for kv in kvs}
            self._synced = True
            self._cond.notify_all()

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._cond:
            for ev in events:
                name = ev.key[len(self._prefix):]
                if ev.value is None:
                    self._cache.pop(name, None)
                else:
                    self._cache[name] = ev.value
            self._cond.notify_all()

    def close(self) -> None:
        self._watch.stop()

    # -- helpers ----------------------------------------------------------------------
    def _retry(self, fn: Callable[[], T]) -> T:
        return call_with_retry(fn, what=f"store {self._prefix}",
                               deadline=time.monotonic() + self._timeout_s)

    def _wait_for(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._synced and all(n in self._cache for n in names):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [n for n in names if n not in self._cache]
                    raise dist.DistStoreError(
                        f"etcd store {self._prefix}: timed out after {timeout_s:.0f}s waiting for "
                        f"keys {missing}"
                    )
                self._cond.wait(min(left, 1.0))

    @staticmethod
    def _bytes(value: Any) -> bytes:
        if isinstance(value, bytes):
            return value
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def _timeout(self, timeout: timedelta | None) -> float:
        return timeout.total_seconds() if timeout is not None else self._timeout_s

    # -- Store API --------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._retry(lambda: self._client.put(self._prefix + key, self._bytes(value)))

    def get(self, key: str) -> bytes:
        self._wait_for([key], self._timeout_s)
        with self._cond:
            return self._cache[key]

    def add(self, key: str, amount: int) -> int:
        full = self._prefix + key
        while True:
            kv = self._retry(lambda: self._client.get(full))
            current = int(kv.value) if kv else 0
            new = current + int(amount)
            rev = kv.mod_revision if kv else 0
            if self._retry(lambda: self._client.put_if(full, str(new), mod_revision=rev)):  # noqa: B023
                return new

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        full = self._prefix + key
        expected, desired = self._bytes(expected_value), self._bytes(desired_value)
        while True:
            kv = self._retry(lambda: self._client.get(full))
            if kv is None and expected != b"":
                return expected  # torch's semantics: a missing key with a non-empty expectation
            if kv is not None and kv.value != expected:
                return kv.value
            rev = kv.mod_revision if kv else 0
            if self._retry(lambda: self._client.put_if(full, desired, mod_revision=rev)):  # noqa: B023
                return desired

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(list(keys), self._timeout(timeout))

    def check(self, keys: list[str]) -> bool:
        return all(self._retry(lambda k=k: self._client.get(self._prefix + k)) is not None for k in keys)

    def delete_key(self, key: str) -> bool:
        return bool(self._retry(lambda: self._client.delete(self._prefix + key)))

    def num_keys(self) -> int:
        return int(self._retry(lambda: self._client.count_prefix(self._prefix)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait_for(list(keys), self._timeout_s)
        with self._cond:
            return [self._cache[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return timedelta(seconds=self._timeout_s)
