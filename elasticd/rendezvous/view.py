"""The rendezvous handler's local view of etcd, kept by watches.

``num_nodes_waiting()`` and ``membership()`` are answered from here with no etcd request.
``snapshot`` turns the raw keys into the protocol's ``RendezvousView``.

Every node watches ``rdzv/`` except ``rdzv/failures/`` and ``rdzv/joins/`` (two key
ranges: the state key, ``attribution``, ``closed``, ``coordinator``, ``left/``): writes
there are O(1) per round or per change, so each costs N watch events. Only the
coordinator (``coordinator.py``) adds watches of ``nodes/``, ``rdzv/joins/`` and
``rdzv/failures/`` (``on_nodes``/``on_joins``/``on_failures``), whose N writes a round
would cost N^2 events if everyone watched them; its view is then *full* (a dead peer shows
up when its lease expires). Everyone else has a *partial* view: no liveness, only its own
joins and failure reports (``add_own_join``/``add_own_failure``), and the coordinator's
verdict once every member reported a failure (``rdzv/attribution``), which is all the
protocol needs from them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

from elasticd.etcd.kv import KV, WatchEvent
from elasticd.keys import NODE_ID_RE, JobKeys, round_of_key
from elasticd.records import (
    AttributionRecord,
    NodeRecord,
    ProbationRecord,
    RecordError,
    RoundState,
    WaitingRecord,
)
from elasticd.rendezvous.liveness import ProbeTarget
from elasticd.rendezvous.protocol import LEAVE_KINDS, RendezvousView

_NOT_SEEN_YET = 1 << 62  # the order of a join whose watch event has not come yet


def _in_order(table: dict[int, list[tuple[int, str]]]) -> dict[int, list[str]]:
    return {r: [n for _, n in sorted(v)] for r, v in table.items()}


def _left_gracefully(record: bytes) -> bool:
    try:
        return NodeRecord.from_json(record).state in ("stopped", "draining")
    except (ValueError, TypeError):
        return False


def _attribution(kv: KV | None) -> tuple[int, tuple[str, ...]] | None:
    """``rdzv/attribution`` as (round, reporters in order), or None if absent or not valid."""
    if kv is None:
        return None
    try:
        rec = AttributionRecord.from_json(kv.value)
    except (RecordError, ValueError, TypeError):
        return None
    if not rec.reporters or not all(NODE_ID_RE.fullmatch(n) for n in rec.reporters):
        return None
    return rec.round, tuple(rec.reporters)


def _probation(rdzv: Mapping[str, KV], root: str) -> dict[str, str]:
    """``rdzv/probation/<node>`` -> node: why it waits, in words (``status``). A record that
    does not decode still keeps its node out (the key is the coordinator's, on a lease)."""
    out: dict[str, str] = {}
    for key, kv in rdzv.items():
        if not key.startswith(root):
            continue
        node = key[len(root):]
        if not NODE_ID_RE.fullmatch(node):
            continue
        try:
            rec = ProbationRecord.from_json(kv.value)
            out[node] = (f"on probation for {rec.probation_s:g}s: quarantined, its ranks' replicas "
                         f"diverged twice, from round {rec.round}" if rec.cause == "diverged" else
                         f"on probation for {rec.probation_s:g}s: ejected as a straggler "
                         f"({rec.ratio:.2f}x the members' median step time) from round {rec.round}")
        except RecordError:
            out[node] = "on probation: ejected as a straggler"
    return out


def _announced(kv: KV | None) -> tuple[int, tuple[str, ...]] | None:
    """``rdzv/waiting`` as (round, nodes), or None if absent or not valid."""
    if kv is None:
        return None
    try:
        rec = WaitingRecord.from_json(kv.value)
    except (RecordError, ValueError, TypeError):
        return None
    if not all(NODE_ID_RE.fullmatch(n) for n in rec.nodes):
        return None
    return rec.round, tuple(rec.nodes)


class WatchedView:
    """Thread-safe cache of ``nodes/`` and ``rdzv/``, fed by two prefix watches.

    ``cond`` guards the tables and is notified on every change; ``version`` counts
    changes, so a waiter can sleep until something happened (``wait_change``).
    """

    def __init__(self, keys: JobKeys, node_id: str = "") -> None:
        self.keys = keys
        self.node_id = node_id
        self.cond = threading.Condition()
        self.nodes: dict[str, KV] = {}  # the coordinator's only
        self.left: set[str] = set()  # nodes whose last record said they stopped (a clean leave)
        self.rdzv: dict[str, KV] = {}  # below rdzv/joins/
        self.rdzv_hi: dict[str, KV] = {}  # above rdzv/joins/
        self.joins: dict[str, KV] = {}  # the coordinator's only
        self.failures: dict[str, KV] = {}  # the coordinator's only
        self.full = False  # nodes/ and joins/ are watched and in sync (we coordinate)
        self.own_joins: dict[int, int] = {}  # round -> lease id our join key was put on
        self.own_failures: dict[int, int] = {}  # round -> lease id our failure report was put on
        self.lease_id = 0  # our current lease: own joins on an older one died with it
        self.version = 0
        # Called (watch thread, under the lock: must not block) after every change; the
        # agent wakes its tick with it (elasticd.agent.wakeup) instead of polling.
        self.listeners: list[Callable[[], None]] = []
        # The coordinator's tables indexed as they change, so that a snapshot copies them
        # instead of parsing every key again: it runs on every change, and at 1,000 nodes
        # re-parsing 1,000 joins each time was 1 ms a snapshot, O(N^2) a round.
        self._alive: set[str] = set()  # node ids under nodes/
        self._joins_by_round: dict[int, dict[str, tuple[int, str]]] = {}  # r -> key -> (create, node)
        self._failures_by_round: dict[int, dict[str, tuple[int, str]]] = {}
        self._nodes_prefix = keys.nodes_prefix
        self._joins_root, self._failures_root = keys.joins_root, keys.failures_root

    def _round_index(self, table: dict[str, KV]) -> tuple[dict[int, dict[str, tuple[int, str]]], str] | None:
        """The per-round index of ``table`` and its keys' root (joins, failures), else None."""
        if table is self.joins:
            return self._joins_by_round, self._joins_root
        if table is self.failures:
            return self._failures_by_round, self._failures_root
        return None

    def _index(self, table: dict[str, KV], key: str, kv: KV | None) -> None:
        """Keep the index of ``table`` in step with ``key`` now being ``kv`` (None: gone)."""
        if table is self.nodes:
            node = key[len(self._nodes_prefix):]
            if kv is None:
                self._alive.discard(node)
            else:
                self._alive.add(node)
            return
        if (found := self._round_index(table)) is None or (r := round_of_key(key, found[1])) is None:
            return
        index = found[0]
        if kv is not None:
            index.setdefault(r, {})[key] = (kv.create_revision, key.rsplit("/", 1)[1])
        elif (entries := index.get(r)) is not None:
            entries.pop(key, None)
            if not entries:
                del index[r]

    def _reindex(self, table: dict[str, KV]) -> None:
        """Rebuild the index of ``table`` from it (after a resync or a step-down)."""
        if table is self.nodes:
            self._alive.clear()
        elif (found := self._round_index(table)) is not None:
            found[0].clear()
        else:
            return
        for key, kv in table.items():
            self._index(table, key, kv)

    def _apply(self, table: dict[str, KV], events: list[WatchEvent]) -> None:
        with self.cond:
            for ev in events:
                if ev.value is None:
                    gone = table.pop(ev.key, None)
                    if gone is not None and table is self.nodes and _left_gracefully(gone.value):
                        self.left.add(ev.key[len(self._nodes_prefix):])
                    self._index(table, ev.key, None)
                else:
                    old = table.get(ev.key)
                    create = old.create_revision if old else ev.mod_revision
                    table[ev.key] = kv = KV(ev.key, ev.value, ev.mod_revision, create, 0)
                    self._index(table, ev.key, kv)
            self._changed()

    def _reset(self, table: dict[str, KV], kvs: list[KV]) -> None:
        with self.cond:
            table.clear()
            table.update({kv.key: kv for kv in kvs})
            self._reindex(table)
            self._changed()

    def _changed(self) -> None:
        self.version += 1
        self.cond.notify_all()
        for listener in self.listeners:
            listener()

    def on_nodes(self, events: list[WatchEvent]) -> None:
        self._apply(self.nodes, events)

    def on_nodes_resync(self, kvs: list[KV], rev: int) -> None:
        self._reset(self.nodes, kvs)

    def on_rdzv(self, events: list[WatchEvent]) -> None:
        self._apply(self.rdzv, events)

    def on_rdzv_resync(self, kvs: list[KV], rev: int) -> None:
        self._reset(self.rdzv, kvs)

    def on_rdzv_hi(self, events: list[WatchEvent]) -> None:
        self._apply(self.rdzv_hi, events)

    def on_rdzv_hi_resync(self, kvs: list[KV], rev: int) -> None:
        self._reset(self.rdzv_hi, kvs)

    def on_joins(self, events: list[WatchEvent]) -> None:
        self._apply(self.joins, events)

    def on_joins_resync(self, kvs: list[KV], rev: int) -> None:
        self._reset(self.joins, kvs)

    def on_failures(self, events: list[WatchEvent]) -> None:
        self._apply(self.failures, events)

    def on_failures_resync(self, kvs: list[KV], rev: int) -> None:
        self._reset(self.failures, kvs)

    def set_full(self, full: bool) -> None:
        """The coordinator's full watches are in sync (True) or were given up (False)."""
        with self.cond:
            self.full = full
            if not full:
                for table in (self.nodes, self.joins, self.failures):
                    table.clear()
                    self._reindex(table)
            self.version += 1
            self.cond.notify_all()

    def add_own_join(self, round_: int, lease_id: int) -> None:
        """Remember that we put our join key for ``round_`` on ``lease_id``."""
        with self.cond:
            self.own_joins[round_] = lease_id
            self.version += 1
            self.cond.notify_all()

    def add_own_failure(self, round_: int, lease_id: int) -> None:
        """Remember that we reported a worker failure in ``round_`` on ``lease_id``."""
        with self.cond:
            self.own_failures[round_] = lease_id
            self._changed()

    def rdzv_get(self, key: str) -> KV | None:
        """A key of ``rdzv/`` outside ``joins/`` (state, closed, coordinator...)."""
        with self.cond:
            return self.rdzv.get(key) or self.rdzv_hi.get(key)

    def snapshot(self) -> tuple[RendezvousView, int]:
        """The protocol's view, plus the state key's mod_revision (0 if absent)."""
        k = self.keys
        with self.cond:
            rdzv = {**self.rdzv, **self.rdzv_hi}
            state_kv = rdzv.get(k.rdzv_state)
            state = RoundState.from_json(state_kv.value) if state_kv else None
            holder = rdzv.get(k.rdzv_coordinator)
            coordinator = holder.value.decode(errors="replace") if holder is not None else None
            joins: dict[int, list[tuple[int, str]]] = {}
            failures: dict[int, list[tuple[int, str]]] = {}
            left: dict[int, dict[str, str]] = {}
            left_root = k.left_root
            for key, kv in rdzv.items():
                r = round_of_key(key, left_root)
                if r is not None and (kind := kv.value.decode(errors="replace")) in LEAVE_KINDS:  # validated: anything else is a loss
                    left.setdefault(r, {})[key.rsplit("/", 1)[1]] = kind
            if self.full:
                alive = frozenset(self._alive)
                joins = {r: list(entries.values()) for r, entries in self._joins_by_round.items()}
                # Our own join is in as soon as its put returned, before the watch shows it
                # (last in order until then): else every other event re-puts it (issue 15's
                # fan-out bound broke under load with 100 puts of one join key).
                for r, lease in self.own_joins.items():
                    if (lease == self.lease_id and (state is None or r >= state.round)
                            and self.keys.join(r, self.node_id) not in self.joins):
                        joins.setdefault(r, []).append((_NOT_SEEN_YET, self.node_id))
                failures = {r: list(entries.values())
                            for r, entries in self._failures_by_round.items()}
            else:
                alive = frozenset()
                for r, lease in self.own_joins.items():
                    if lease == self.lease_id:
                        joins[r] = [(0, self.node_id)]
            attributed = _attribution(rdzv.get(k.rdzv_attribution))
            if attributed is not None and not self.full:
                r, reporters = attributed
                failures[r] = list(enumerate(reporters))
            for r, lease in self.own_failures.items():
                if (lease == self.lease_id and (state is None or r >= state.round)
                        and self.node_id not in (n for _, n in failures.get(r, ()))):
                    failures.setdefault(r, []).append((_NOT_SEEN_YET, self.node_id))
            announced = _announced(rdzv.get(k.rdzv_waiting))
            ordered = _in_order(joins)
            if announced is not None and not self.full:
                r, waiting = announced
                ordered[r] = [*ordered.get(r, []), *(n for n in waiting if n != self.node_id)]
            closed = k.rdzv_closed in rdzv
            return (RendezvousView(state, alive, ordered, closed, _in_order(failures), left,
                                   coordinator=coordinator, full=self.full, announced=announced,
                                   attributed=attributed[0] if attributed is not None else None,
                                   probation=_probation(rdzv, k.probation_root)),
                    state_kv.mod_revision if state_kv else 0)

    def probe_targets(self, nodes: Iterable[str]) -> list[ProbeTarget]:
        """Where to probe ``nodes`` (the coordinator's full view only): from their records.

        A node whose record is unreadable or publishes no probe port is left out (it is
        never proven dead; its lease decides).
        """
        with self.cond:
            kvs = [(n, self.nodes.get(self.keys.node(n))) for n in nodes]
        return [t for n, kv in kvs if (t := ProbeTarget.of_record(n, kv)) is not None]

    def proven_dead(self, dead: Mapping[str, int]) -> frozenset[str]:
        """The nodes of ``dead`` (node -> incarnation proven dead) whose current record is
        still that incarnation (a restarted agent's new record is not dead)."""
        with self.cond:
            return frozenset(n for n, inc in dead.items()
                             if (kv := self.nodes.get(self.keys.node(n))) is not None
                             and kv.create_revision == inc)

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
