"""The agent's side of ``elasticd stop`` / ``elasticd drain`` (see elasticd.stopmarks).

Two hooks, nothing in the supervision loop itself:

- :func:`refusal_at_start`: the stop marks read with retries, the ``STOP`` check of the boot
  sequence after the torch import (:mod:`elasticd.agent.boot` says where else it runs): a
  stopped job or a drained node is a clean exit 0 (systemd restarting the agent, or a
  reboot, must not bring it back), with a line that says how to start again;
- :class:`RemoteStopWatch`: a watch on ``/elasticd/<job>/control/`` that turns a mark
  written while the agent runs into the same drain as SIGTERM (``request_drain``): all
  ranks stop after the same step, save, exit 0, and the agent leaves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from elasticd.etcd.client import KV, EtcdClient, PrefixWatch, WatchEvent
from elasticd.keys import JobKeys
from elasticd.retry import call_with_retry
from elasticd.stopmarks import StopRequest, pending_request, read_request

log = structlog.get_logger(__name__)


def refusal_at_start(client: EtcdClient, keys: JobKeys, node_id: str, *,
                     deadline_s: float = 30.0) -> StopRequest | None:
    """The stop or drain that keeps this agent out of the job, or None to go on.

    Raises:
        TransientError: etcd stayed unreachable for ``deadline_s``.
    """
    return call_with_retry(lambda: read_request(client, keys, node_id), what="read stop marks",
                           deadline=time.monotonic() + deadline_s)


class RemoteStopWatch:
    """Calls ``on_request(request)`` once, when a stop or a drain of this node appears.

    Args:
        client: the agent's etcd client.
        keys: the job's keys.
        node_id: this agent's node id.
        on_request: called from the watch thread (it must only set flags, like
            ``ElasticdAgent.request_drain``).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str,
                 on_request: Callable[[StopRequest], None]) -> None:
        self._client, self._keys, self._node = client, keys, node_id
        self._on_request = on_request
        self._table: dict[str, KV] = {}
        self._lock = threading.Lock()
        self._watch: PrefixWatch | None = None
        self.fired: StopRequest | None = None

    def start(self) -> RemoteStopWatch:
        self._watch = self._client.watch_prefix(self._keys.control_prefix, self._on_events,
                                                self._on_resync, name="control")
        return self

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop(wait=False)

    def _on_resync(self, kvs: list[KV], _rev: int) -> None:
        with self._lock:
            self._table = {kv.key: kv for kv in kvs}
        self._check()

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._lock:
            for ev in events:
                if ev.value is None:
                    self._table.pop(ev.key, None)
                else:
                    self._table[ev.key] = KV(ev.key, ev.value, ev.mod_revision, 0, 0)
        self._check()

    def _check(self) -> None:
        with self._lock:
            if self.fired is not None:
                return
            req = pending_request(self._table.values(), self._keys, self._node)
            if req is None:
                return
            self.fired = req
        log.info("operator_stop_received", reason=req.reason,
                 kind="stop" if req.node is None else "drain")
        self._on_request(req)
