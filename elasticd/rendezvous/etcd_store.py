"""A c10d ``Store`` on etcd, one key prefix per rendezvous round.

torch's agent uses the rendezvous store during a round to assign worker ranks, publish
MASTER_ADDR/PORT and run its exit barrier. Keeping it in etcd (not in a TCPStore hosted
by one agent) means losing any node never loses the store, and giving every round its
own prefix means workers of round r+1 can never read round r's addresses.

Every value returned comes from a read of etcd, never from a watch cache: a watch lags,
and a cached value could be older than a write that already completed (another node's
``add``, or our own second ``set``), which the c10d contract forbids. Blocking reads
(``get``/``wait``) do not poll: a key they find missing is watched (only the smallest key
range that covers the missing keys, and only while they block), and a change in it wakes
them to read again. A store never watches its whole prefix: with N nodes that would
deliver every node's writes to every node (O(N^2) watch events a round, e.g. for
torch's per-rank keys); a read that finds its key costs no watch at all. Transient etcd
errors are retried until the store timeout.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousStoreInfo
from torch.distributed.elastic.utils.distributed import get_free_port

from elasticd.etcd.client import KV, EtcdClient, PrefixWatch, WatchEvent
from elasticd.etcd.txn import Put
from elasticd.retry import call_with_retry

T = TypeVar("T")
# torch's agent stores addresses, ranks and barrier counters here: bytes, not megabytes.
# A bound keeps one caller from filling etcd (its request limit is 1.5 MiB, its space is
# shared by every job); the workers' own TCPStore has no such bound (docs/security.md).
MAX_VALUE_BYTES = 64 * 1024
MAX_COUNTER_DIGITS = 32


class RoundAbandonedError(dist.DistStoreError):
    """A blocking read of a round's store ended because the round can no longer complete:
    a member it waits for left or was lost, or a newer round superseded it. The agent
    rendezvouses again at once instead of waiting out the store timeout."""


class EtcdStore(dist.Store):
    """c10d Store backed by etcd keys under ``prefix``.

    Args:
        client: the etcd client.
        prefix: key prefix of this round's store (``JobKeys.store_prefix(round)``).
        timeout_s: default timeout of blocking calls (``get``, ``wait``) and of retries.
        abandoned: asked while a read blocks (at least once a second): why the round can no
            longer complete, or ``""``. Without it, a member that left a round just as it
            became final held every other member in torch's rank exchange (rank 0's address,
            every node's ranks) for the whole store timeout (the live spot replay: 7 nodes
            idle for over 2 minutes, their workers falling back to the checkpoint).
    """

    def __init__(self, client: EtcdClient, prefix: str, timeout_s: float = 300.0,
                 abandoned: Callable[[], str] | None = None) -> None:
        super().__init__()
        self._abandoned = abandoned
        self._client = client
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._version = 0  # bumped on every change a blocked reader watches: wakes it
        self._closed = False
        self._watches: set[PrefixWatch] = set()  # those of the reads blocked right now

    # -- watch: a wake-up signal only (values are read from etcd) -----------------------
    def _on_resync(self, kvs: list[KV], revision: int) -> None:
        self._changed()

    def _on_events(self, events: list[WatchEvent]) -> None:
        self._changed()

    def _changed(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def close(self, wait: bool = True) -> None:
        with self._cond:
            self._closed = True
            watches, self._watches = list(self._watches), set()
        for w in watches:
            w.stop(wait=wait)

    def _watch_missing(self, missing: list[str]) -> PrefixWatch:
        """Watch the smallest key range holding every name in ``missing`` (until stopped)."""
        start = self._prefix + min(missing)
        end = self._prefix + max(missing) + "\0"  # the range end is exclusive
        w = self._client.watch_prefix(start, self._on_events, self._on_resync,
                                      name=f"store:{start}", range_end=end)
        with self._cond:
            self._watches.add(w)
        return w

    def _unwatch(self, w: PrefixWatch) -> None:
        with self._cond:
            self._watches.discard(w)
        w.stop(wait=False)  # never spend the caller's time (etcd may be down)

    # -- helpers ----------------------------------------------------------------------
    def _retry(self, fn: Callable[[], T]) -> T:
        return call_with_retry(fn, what=f"store {self._prefix}",
                               deadline=time.monotonic() + self._timeout_s)

    def _read(self, names: list[str]) -> dict[str, bytes]:
        if len(names) == 1:
            kv = self._retry(lambda: self._client.get(self._prefix + names[0]))
            return {names[0]: kv.value} if kv is not None else {}
        kvs, _ = self._retry(lambda: self._client.get_prefix(self._prefix))
        wanted = set(names)
        return {name: kv.value for kv in kvs if (name := kv.key[len(self._prefix):]) in wanted}

    def _wait_for(self, names: list[str], timeout_s: float) -> list[bytes]:
        """Read ``names`` from etcd, waiting (woken by the watch) until all exist."""
        deadline = time.monotonic() + timeout_s
        watch: PrefixWatch | None = None
        try:
            while True:
                with self._cond:
                    version = self._version
                found = self._read(names)
                if all(n in found for n in names):
                    return [found[n] for n in names]
                missing = [n for n in names if n not in found]
                if self._abandoned is not None and (why := self._abandoned()):
                    raise RoundAbandonedError(f"etcd store {self._prefix}: stopped waiting for keys "
                                              f"{missing}: {why}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise dist.DistStoreError(
                        f"etcd store {self._prefix}: timed out after {timeout_s:.0f}s waiting for "
                        f"keys {missing}"
                    )
                if watch is None and not self._closed:
                    # Its first snapshot bumps the version: the loop reads once more, so a
                    # key written between our read and the watch's start is not missed.
                    watch = self._watch_missing(missing)
                with self._cond:
                    if self._version == version:  # nothing changed since the read: sleep till then
                        # The 1 s cap re-reads even if the watch is down (etcd restarting).
                        self._cond.wait(min(left, 1.0))
        finally:
            if watch is not None:
                self._unwatch(watch)

    @staticmethod
    def _bytes(value: Any) -> bytes:
        if isinstance(value, bytes):
            data = value
        elif isinstance(value, str):
            data = value.encode()
        else:
            data = bytes(value)
        if len(data) > MAX_VALUE_BYTES:
            raise ValueError(f"store value of {len(data)} bytes is over the {MAX_VALUE_BYTES}-byte "
                             "limit of the rendezvous store (it holds addresses and counters)")
        return data

    def _timeout(self, timeout: timedelta | None) -> float:
        return timeout.total_seconds() if timeout is not None else self._timeout_s

    # -- Store API --------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._retry(lambda: self._client.put(self._prefix + key, self._bytes(value)))

    def get(self, key: str) -> bytes:
        return self._wait_for([key], self._timeout_s)[0]

    def add(self, key: str, amount: int) -> int:
        full = self._prefix + key
        while True:
            kv = self._retry(lambda: self._client.get(full))
            if kv is not None and (len(kv.value) > MAX_COUNTER_DIGITS
                                   or not kv.value.strip().lstrip(b"-").isdigit()):
                raise ValueError(f"store key {key!r} does not hold a counter")
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
        found = self._read(list(keys))
        return all(k in found for k in keys)

    def delete_key(self, key: str) -> bool:
        return bool(self._retry(lambda: self._client.delete(self._prefix + key)))

    def num_keys(self) -> int:
        return int(self._retry(lambda: self._client.count_prefix(self._prefix)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_for(list(keys), self._timeout_s)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        """Write every key in one transaction: a reader sees all of them or none."""
        ops = [Put(self._prefix + k, self._bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._retry(lambda: self._client.txn([], ops))

    def bootstrap_info(self, rank: int, local_addr: str | None) -> RendezvousStoreInfo:
        """torch's ``RendezvousStoreInfo.build`` (rank 0 publishes its address and a free
        port, every rank reads them) in fewer etcd requests: rank 0 writes both in one
        transaction and keeps what it wrote, the others read both in one request. At
        1,000 nodes a round is bound by etcd's requests (docs/benchmarks.md)."""
        keys = [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]
        if rank == 0:
            addr, port = local_addr or socket.getfqdn(), get_free_port()
            self.multi_set(keys, [addr.encode(), str(port).encode()])
            return RendezvousStoreInfo(master_addr=addr, master_port=port)
        addr_b, port_b = self.multi_get(keys)
        return RendezvousStoreInfo(master_addr=addr_b.decode(), master_port=int(port_b.decode()))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return timedelta(seconds=self._timeout_s)
