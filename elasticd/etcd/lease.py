"""``LeaseKeeper``: keeps one etcd lease alive from a background thread.

python3-etcd3 grants leases but does not keep them alive; this is the node's heartbeat
(DESIGN.md decision 2: liveness costs one keep-alive per node, nothing shared rewritten).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from elasticd.etcd.client import EtcdClient

log = structlog.get_logger(__name__)


class LeaseKeeper:
    """Keeps one lease alive from a background thread.

    Keep-alives go out every ``ttl_s / 3``. Transient etcd errors are tolerated (the lease
    lives on the server until its TTL runs out, and etcd renews every lease's TTL when
    it restarts). If etcd answers that the lease is gone, ``lost`` is set and
    ``on_lost`` is called once: this node was frozen or cut off for longer than its TTL.
    """

    def __init__(self, client: EtcdClient, lease_id: int, ttl_s: int,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.client = client
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.lost = threading.Event()
        self.last_ok = time.monotonic()
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease:{lease_id:x}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self, revoke: bool = False) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        if revoke and not self.lost.is_set():
            try:
                self.client.revoke_lease(self.lease_id)
            except Exception as exc:  # best effort: the TTL will expire it anyway
                log.warning("lease_revoke_failed", lease=hex(self.lease_id), error=str(exc))

    def _run(self) -> None:
        interval = max(self.ttl_s / 3.0, 0.2)
        # A keep-alive sent to a frozen or dead member must not eat the TTL: bounded by a
        # third of it, the retry on the next member still lands before the lease expires.
        call_timeout_s = min(self.client.timeout_s, interval)
        failing = False
        while not self._stop.wait(interval if not failing else min(interval, 0.25)):
            try:
                ttl = self.client.refresh_lease(self.lease_id, timeout_s=call_timeout_s)
            except Exception as exc:
                if not failing:
                    log.warning("lease_keepalive_failed", lease=hex(self.lease_id), error=str(exc))
                failing = True
                continue
            if failing:
                log.info("lease_keepalive_resumed", lease=hex(self.lease_id), ttl_s=ttl)
                failing = False
            if ttl <= 0:
                self.lost.set()
                log.warning("lease_lost", lease=hex(self.lease_id))
                if self._on_lost:
                    self._on_lost()
                return
            self.last_ok = time.monotonic()


