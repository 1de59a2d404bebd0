"""The rendezvous handler's local view of etcd: ``nodes/`` and ``rdzv/``, kept by watches.

``num_nodes_waiting()`` and ``membership()`` are answered from here with no etcd request,
and a dead peer shows up when its lease expires (the watch delivers the deletion), not
when a gloo/NCCL timeout fires minutes later. ``snapshot`` turns the raw keys into the
protocol's ``RendezvousView``.
"""

from __future__ import annotations

import threading

from elasticd.etcd.kv import KV, WatchEvent
from elasticd.keys import JobKeys, round_of_key
from elasticd.records import NodeRecord, RoundState
from elasticd.rendezvous.protocol import LEAVE_KINDS, RendezvousView


def _in_order(table: dict[int, list[tuple[int, str]]]) -> dict[int, list[str]]:
    return {r: [n for _, n in sorted(v)] for r, v in table.items()}


def _left_gracefully(record: bytes) -> bool:
    try:
        return NodeRecord.from_json(record).state in ("stopped", "draining")
    except (ValueError, TypeError):
        return False


class WatchedView:
    """Thread-safe cache of ``nodes/`` and ``rdzv/``, fed by two prefix watches.

    ``cond`` guards the tables and is notified on every change; ``version`` counts
    changes, so a waiter can sleep until something happened (``wait_change``).
    """

    def __init__(self, keys: JobKeys) -> None:
        self.keys = keys
        self.cond = threading.Condition()
        self.nodes: dict[str, KV] = {}
        self.left: set[str] = set()  # nodes whose last record said they stopped (a clean leave)
        self.rdzv: dict[str, KV] = {}
        self.version = 0

    def _apply(self, table: dict[str, KV], events: list[WatchEvent]) -> None:
        with self.cond:
            for ev in events:
                if ev.value is None:
                    gone = table.pop(ev.key, None)
                    if gone is not None and table is self.nodes and _left_gracefully(gone.value):
                        self.left.add(ev.key[len(self.keys.nodes_prefix):])
                else:
                    old = table.get(ev.key)
                    create = old.create_revision if old else ev.mod_revision
                    table[ev.key] = KV(ev.key, ev.value, ev.mod_revision, create, 0)
            self.version += 1
            self.cond.notify_all()

    def _reset(self, table: dict[str, KV], kvs: list[KV]) -> None:
        with self.cond:
            table.clear()
            table.update({kv.key: kv for kv in kvs})
            self.version += 1
            self.cond.notify_all()

    def on_nodes(self, events: list[WatchEvent]) -> None:
        self._apply(self.nodes, events)

    def on_nodes_resync(self, kvs: list[KV], rev: int) -> None:
        self._reset(self.nodes, kvs)

    def on_rdzv(self, events: list[WatchEvent]) -> None:
        self._apply(self.rdzv, events)

    def on_rdzv_resync(self, kvs: list[KV], rev: int) -> None:
        self._reset(self.rdzv, kvs)

    def snapshot(self) -> tuple[RendezvousView, int]:
        """The protocol's view, plus the state key's mod_revision (0 if absent)."""
        with self.cond:
            state_kv = self.rdzv.get(self.keys.rdzv_state)
            state = RoundState.from_json(state_kv.value) if state_kv else None
            alive = frozenset(k[len(self.keys.nodes_prefix):] for k in self.nodes)
            joins: dict[int, list[tuple[int, str]]] = {}
            failures: dict[int, list[tuple[int, str]]] = {}
            left: dict[int, dict[str, str]] = {}
            for key, kv in self.rdzv.items():
                for root, table in ((self.keys.joins_root, joins),
                                    (self.keys.failures_root, failures)):
                    r = round_of_key(key, root)
                    if r is not None:
                        table.setdefault(r, []).append((kv.create_revision, key.rsplit("/", 1)[1]))
                r = round_of_key(key, self.keys.left_root)
                if r is not None and (kind := kv.value.decode(errors="replace")) in LEAVE_KINDS:  # validated: anything else is a loss
                    left.setdefault(r, {})[key.rsplit("/", 1)[1]] = kind
            closed = self.keys.rdzv_closed in self.rdzv
            return (RendezvousView(state, alive, _in_order(joins), closed, _in_order(failures), left),
                    state_kv.mod_revision if state_kv else 0)

    def touch(self) -> None:
        """Count a change that came from outside the watches (our lease was lost), so
        every ``wait_change`` returns at once."""
        with self.cond:
            self.version += 1
            self.cond.notify_all()

    def wait_change(self, version: int, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` unless the view changed since ``version``."""
        with self.cond:
            if self.version == version:
                self.cond.wait(max(timeout_s, 0.0))
