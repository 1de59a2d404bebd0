"""``EtcdRendezvousHandler``: torch elastic's rendezvous on etcd v3 primitives.

- Liveness is a lease per node, kept alive by ``LeaseKeeper`` (O(1) per node per
  keep-alive, no shared blob rewritten). The node key ``nodes/<node>`` sits on it; its
  create_revision is this node's *incarnation*, the fencing token of every later write.
- Every state change is a transaction comparing the state key's mod_revision; the
  decisions are pure functions in ``protocol.py``.
- Two watches (``nodes/`` and ``rdzv/``) keep a local view, so ``num_nodes_waiting()``
  and ``membership()`` cost no etcd request and a dead peer is noticed when its lease expires, not when a
  gloo/NCCL timeout fires minutes later.
- An unreachable etcd is not a dead peer: while etcd is down the view does not change,
  so healthy workers keep training; calls are retried with backoff.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import structlog
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elasticd import __version__
from elasticd.errors import ConfigError, EtcdUnavailableError, LeaseLostError, TransientError
from elasticd.etcd.client import KV, EtcdClient, LeaseKeeper, PrefixWatch, WatchEvent
from elasticd.keys import JobKeys, round_of_key
from elasticd.records import NodeRecord, RoundState
from elasticd.rendezvous.etcd_store import EtcdStore
from elasticd.rendezvous.protocol import (
    Action,
    ActionKind,
    JoinProgress,
    MembershipChange,
    RendezvousView,
    Waiting,
    decide_join,
    lost_members,
    nodes_waiting,
)
from elasticd.retry import call_with_retry

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RendezvousSettings:
    """Timing and size of the rendezvous (all durations in seconds)."""

    min_nodes: int
    max_nodes: int
    node_ttl_s: int = 5
    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 1.0
    close_timeout_s: float = 30.0
    store_timeout_s: float = 300.0
    local_addr: str | None = None
    worker_log_dir: str | None = None  # published in the node record, for `elasticd status`


def default_node_id() -> str:
    """``<host>-<pid>``: unique per agent process on a machine, readable in ``status``."""
    host = socket.gethostname().split(".")[0] or "node"
    return f"{host}-{os.getpid()}"


def _in_order(table: dict[int, list[tuple[int, str]]]) -> dict[int, list[str]]:
    return {r: [n for _, n in sorted(v)] for r, v in table.items()}


def _left_gracefully(record: bytes) -> bool:
    try:
        return NodeRecord.from_json(record).state in ("stopped", "draining")
    except (ValueError, TypeError):
        return False


class _View:
    """Thread-safe cache of ``nodes/`` and ``rdzv/``, fed by two prefix watches."""

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
            for key, kv in self.rdzv.items():
                for root, table in ((self.keys.joins_root, joins),
                                    (self.keys.failures_root, failures)):
                    r = round_of_key(key, root)
                    if r is not None:
                        table.setdefault(r, []).append((kv.create_revision, key.rsplit("/", 1)[1]))
            closed = self.keys.rdzv_closed in self.rdzv
            return (RendezvousView(state, alive, _in_order(joins), closed, _in_order(failures)),
                    state_kv.mod_revision if state_kv else 0)

    def wait_change(self, version: int, timeout_s: float) -> None:
        with self.cond:
            if self.version == version:
                self.cond.wait(max(timeout_s, 0.0))


class EtcdRendezvousHandler(RendezvousHandler):
    """A torch elastic ``RendezvousHandler`` on etcd v3 (backend name ``etcd-v3``).

    Args:
        client: etcd client; the caller closes it after ``shutdown`` (the handler does not).
        job: job name (the run id); keys live under ``/elasticd/<job>/``.
        settings: sizes and timeouts.
        node_id: this node's id; ``<host>-<pid>`` by default.
        on_lease_lost: called (from the keep-alive thread) when this node's lease is found
            expired, i.e. the node was frozen or cut off longer than its TTL.
    """

    def __init__(self, client: EtcdClient, job: str, settings: RendezvousSettings, *,
                 node_id: str | None = None,
                 on_lease_lost: Callable[[], None] | None = None) -> None:
        self.client = client
        self.keys = JobKeys(job)
        self.settings = settings
        self.node_id = node_id or default_node_id()
        self.keys.node(self.node_id)  # validates the id
        self._on_lease_lost = on_lease_lost
        self._view = _View(self.keys)
        self._watches: list[PrefixWatch] = []
        self._keeper: LeaseKeeper | None = None
        self._incarnation = 0  # create_revision of our node key
        self._record: NodeRecord | None = None
        self._round: int | None = None  # last round we completed
        self._members: tuple[str, ...] = ()
        self._state_rev = 0  # mod_revision of the state key when our round completed
        self._lease_loss: int | None = None  # round we were in when our lease was lost
        self._loss_seen_at: float | None = None  # first sight of lost members after an outage
        self._store: EtcdStore | None = None
        self._last_reason = ""
        self._shutdown = False
        self.lease_lost = threading.Event()
        # Set (plain assignment, safe from a signal handler) when this node must stop:
        # next_rendezvous then raises RendezvousGracefulExitError within a second.
        self.stop_requested: str | None = None
        self.rendezvous_s = 0.0
        # Called while waiting for a round (e.g. the systemd watchdog ping of the agent).
        self.on_wait: Callable[[], None] | None = None
        # Called with the members whose lease expired when we open the next round for it.
        self.on_members_lost: Callable[[list[str], int], None] | None = None
        self._log = log.bind(job=job, node=self.node_id)

    # -- lifecycle ----------------------------------------------------------------------
    def _retry(self, what: str, fn: Callable[[], Any], deadline: float) -> Any:
        try:
            return call_with_retry(fn, what=what, deadline=deadline)
        except TransientError as exc:
            raise RendezvousConnectionError(f"{what}: {exc}") from exc

    def _ensure_started(self, deadline: float) -> None:
        if not self._watches:
            # One plain read first: bad TLS files or credentials surface as ConfigError now
            # (watches would retry them silently until join_timeout), and an unreachable etcd
            # is reported with gRPC's reason.
            self._retry("connect to etcd", lambda: self.client.get(self.keys.rdzv_state), deadline)
            self._watches = [
                self.client.watch_prefix(self.keys.nodes_prefix, self._view.on_nodes,
                                         self._view.on_nodes_resync, name="nodes"),
                self.client.watch_prefix(self.keys.rdzv_prefix, self._view.on_rdzv,
                                         self._view.on_rdzv_resync, name="rdzv"),
            ]
            for w in self._watches:
                if not w.connected.wait(max(deadline - time.monotonic(), 0.1)):
                    raise RendezvousConnectionError(
                        f"cannot watch etcd at {self.client.endpoint_label()}: is it running?"
                    )
        if self._keeper is None:
            self._reopen_finished_job(deadline)
        elif not self._keeper.lost.is_set():
            # Our keep-alive thread may not have noticed yet (we were frozen): ask etcd.
            try:
                if self.client.refresh_lease(self._keeper.lease_id) <= 0:
                    self._keeper.lost.set()
                    self.lease_lost.set()
            except EtcdUnavailableError:
                pass  # etcd down: the join below retries, and the keeper keeps trying
        if self._keeper is None or self._keeper.lost.is_set():
            self._register(deadline)

    def _reopen_finished_job(self, deadline: float) -> None:
        """A closed job with no live node is a finished run: start the job name afresh.

        The reset is one transaction guarded by the closed flag's mod_revision. When the
        nodes of a rerun start together they all see the same closed snapshot; only the
        first may reset. A slower node's unguarded delete used to wipe the round the others
        had formed meanwhile and start a second "round 0": two final rounds, each training
        on its own (split brain).
        """
        k = self.keys
        view, _ = self._view.snapshot()
        with self._view.cond:
            closed = self._view.rdzv.get(k.rdzv_closed)
        if not (view.closed and not view.alive and closed is not None):
            return
        if self._retry("reopen job", lambda: self.client.delete_prefixes_if(
                k.rdzv_closed, mod_revision=closed.mod_revision,
                prefixes=[k.rdzv_prefix, k.store_root]), deadline):
            self._log.info("finished_job_reopened")
        # Whoever reset it, wait until our watch shows that closed flag gone, so the join
        # below does not read the old flag and give up with RendezvousClosedError.
        end = min(deadline, time.monotonic() + 5.0)
        with self._view.cond:
            while (now := time.monotonic()) < end:
                current = self._view.rdzv.get(k.rdzv_closed)
                if current is None or current.mod_revision != closed.mod_revision:
                    break
                self._view.cond.wait(end - now)

    def _register(self, deadline: float) -> None:
        """Grant a fresh lease and put our node record on it (a new incarnation)."""
        if self._keeper is not None:
            if self._keeper.lost.is_set():
                self._lease_loss = self._round
                self._log.warning("lease_replaced", round=self._round)
            self._keeper.stop()
        key = self.keys.node(self.node_id)
        if self._record is None:
            # Before the lease grant: waiting out another machine's lease can take a TTL.
            self._retire_previous_process(key, deadline)
        lease = self._retry("lease grant", lambda: self.client.grant_lease(self.settings.node_ttl_s),
                            deadline)
        record = self._record or NodeRecord(
            node=self.node_id, host=socket.gethostname(), pid=os.getpid(), version=__version__,
            started_at=time.time(), log_dir=self.settings.worker_log_dir,
        )
        record = replace(record, state="joining", heartbeat_at=time.time())
        self._retry("node record", lambda: self.client.put(key, record.to_json(), lease=lease), deadline)
        kv = self._retry("node record", lambda: self.client.get(key), deadline)
        self._incarnation = kv.create_revision if kv else 0
        self._record = record
        self.lease_lost.clear()
        self._keeper = LeaseKeeper(self.client, lease, self.settings.node_ttl_s,
                                   on_lost=self._lease_lost).start()
        self._log.info("node_registered", lease=hex(lease), incarnation=self._incarnation)

    def _retire_previous_process(self, key: str, deadline: float) -> None:
        """Our node key exists before this process ever wrote it: the previous process of
        this node id (killed, restarted within its TTL) or a duplicate id.

        A live duplicate (two agents configured with one node id) is refused with a
        ConfigError: on this host, when the recorded pid is a live elasticd process; on
        another host, when its lease is still kept alive after a full TTL (a vanished
        machine's lease expires within one).

        Overwriting it in place would keep its create_revision (the old process's fencing
        token stays valid) and let us inherit its seat in a final round we never ran in:
        DONE at once with its rank, while the other members see no membership change.
        So delete it (a fresh incarnation) and count its round as used, so that we open
        the next round and everyone re-forms.
        """
        old = self._retry("node record", lambda: self.client.get(key), deadline)
        if old is None:
            return
        old = self._refuse_live_duplicate(key, old, deadline)
        if old is None:
            return
        state = self._view.snapshot()[0].state
        if state is not None and state.phase == "final" and self.node_id in state.members:
            self._round = state.round
        self._retry("node record", lambda: self.client.delete(key), deadline)
        self._log.warning("previous_process_retired", old_lease=hex(old.lease), round=self._round)

    def _refuse_live_duplicate(self, key: str, old: KV, deadline: float) -> KV | None:
        """Raise ConfigError if ``old`` belongs to a live agent; else return it (or None
        if it expired meanwhile)."""
        try:
            rec = NodeRecord.from_json(old.value)
        except (ValueError, TypeError):
            return old  # not a record we wrote: retire it
        fix = (f"node id {self.node_id!r} is already used by a live elasticd agent "
               f"(host {rec.host}, pid {rec.pid}); give every agent its own node id "
               "(--node-id, node.id), or leave it unset for HOST-PID")
        if rec.host == socket.gethostname():
            if rec.pid != os.getpid() and _is_live_elasticd(rec.pid):
                raise ConfigError(fix)
            return old  # our own previous process, now dead: retire it at once
        # Another machine: a vanished one's lease runs out within one TTL (and etcd's
        # expiry loop); a live duplicate keeps it.
        until = min(deadline, time.monotonic() + self.settings.node_ttl_s + 2.0)
        self._log.warning("node_id_held_elsewhere", host=rec.host, pid=rec.pid,
                          wait_s=round(until - time.monotonic(), 1))
        while (left := until - time.monotonic()) > 0:
            with self._view.cond:  # the nodes watch shows the key's deletion at expiry
                cur, version = self._view.nodes.get(key), self._view.version
            if cur is None or cur.create_revision != old.create_revision:
                return cur
            self._view.wait_change(version, left)
        raise ConfigError(fix)

    def _lease_lost(self) -> None:
        self.lease_lost.set()
        with self._view.cond:
            self._view.version += 1
            self._view.cond.notify_all()
        if self._on_lease_lost:
            self._on_lease_lost()

    @property
    def lease_id(self) -> int:
        return self._keeper.lease_id if self._keeper else 0

    @property
    def incarnation(self) -> int:
        """create_revision of this node's key: the fencing token of its writes."""
        return self._incarnation

    @property
    def round(self) -> int | None:
        return self._round

    @property
    def round_state_revision(self) -> int:
        """mod_revision of the round state key when our round completed (the round fence)."""
        return self._state_rev

    @property
    def members(self) -> tuple[str, ...]:
        return self._members

    # -- RendezvousHandler API -----------------------------------------------------------
    def get_backend(self) -> str:
        return "etcd-v3"

    @property
    def use_agent_store(self) -> bool:
        # Workers bootstrap from a fresh TCPStore hosted by their rank 0 each round.
        return False

    def get_run_id(self) -> str:
        return self.keys.job

    def next_rendezvous(self) -> RendezvousInfo:
        """Block until this node is in a final round; see ``RendezvousHandler``.

        Raises:
            RendezvousClosedError: the job was closed.
            RendezvousTimeoutError: no round completed within ``join_timeout_s``.
            RendezvousConnectionError: etcd stayed unreachable until the deadline.
        """
        start = time.monotonic()
        deadline = start + self.settings.join_timeout_s
        self._ensure_started(deadline)
        if self._store is not None:
            self._store.close(wait=False)  # etcd may be down: never spend the deadline here
            self._store = None
        progress = JoinProgress(self.node_id, self._round, deadline)
        while True:
            if self.stop_requested:
                raise RendezvousGracefulExitError(
                    f"job {self.keys.job!r}: {self.stop_requested} while waiting for a round")
            if self.lease_lost.is_set():
                self._register(deadline)
            view, state_rev = self._view.snapshot()
            version = self._view.version
            action = decide_join(view, progress, min_nodes=self.settings.min_nodes,
                                 max_nodes=self.settings.max_nodes,
                                 last_call_timeout_s=self.settings.last_call_timeout_s,
                                 now=time.monotonic())
            if action.reason != self._last_reason:
                self._log.info("rendezvous_step", action=action.kind.value, reason=action.reason)
                self._last_reason = action.reason
            if action.kind is ActionKind.DONE:
                self._state_rev = state_rev
                break
            self._execute(action, view, state_rev, version, deadline)
        rank = action.members.index(self.node_id)
        self._round = action.round
        self._members = action.members
        store = EtcdStore(self.client, self.keys.store_prefix(action.round),
                          timeout_s=self.settings.store_timeout_s)
        self._store = store
        bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self.settings.local_addr)
        self.rendezvous_s = time.monotonic() - start
        self._log.info("rendezvous_completed", round=action.round, rank=rank,
                       world_size=len(action.members), members=list(action.members),
                       seconds=round(self.rendezvous_s, 3))
        return RendezvousInfo(store, rank, len(action.members), bootstrap)

    def _execute(self, action: Action, view: RendezvousView, state_rev: int, version: int,
                 deadline: float) -> None:
        s, k = self.settings, self.keys
        if action.kind is ActionKind.CLOSED:
            raise RendezvousClosedError(f"job {k.job!r} is closed")
        if action.kind is ActionKind.TIMEOUT:
            if (err := self.client.unreachable()) is not None:
                raise RendezvousConnectionError(
                    f"job {k.job!r}: etcd stayed unreachable until join_timeout="
                    f"{s.join_timeout_s:.0f}s passed: {err}")
            raise RendezvousTimeoutError(
                f"job {k.job!r}: no round with {s.min_nodes}..{s.max_nodes} nodes completed within "
                f"join_timeout={s.join_timeout_s:.0f}s ({self._last_reason})"
            )
        now = time.time()
        if action.kind is ActionKind.INIT:
            state = RoundState(0, "open", [], s.min_nodes, s.max_nodes, opened_at=now)
            self._retry("open round", lambda: self.client.put_if(k.rdzv_state, state.to_json(),
                                                                 mod_revision=0), deadline)
        elif action.kind is ActionKind.OPEN_NEXT:
            assert view.state is not None
            state = RoundState(action.round, "open", list(view.state.members), s.min_nodes,
                               s.max_nodes, opened_at=now)
            if self._retry("open round", lambda: self.client.put_if(
                    k.rdzv_state, state.to_json(), mod_revision=state_rev), deadline):
                self._log.info("round_opened", round=action.round, reason=action.reason)
                lost = lost_members(view.state, view.alive)
                if lost and self.on_members_lost is not None:
                    self.on_members_lost(lost, view.state.round)
                self._gc_before(action.round)
        elif action.kind is ActionKind.JOIN:
            try:
                self._retry("join", lambda: self.client.put(k.join(action.round, self.node_id), b"1",
                                                            lease=self.lease_id), deadline)
            except LeaseLostError:
                # Our lease expired before the keep-alive thread noticed: re-register
                # (a new incarnation) at the top of the loop, then join.
                if self._keeper is not None:
                    self._keeper.lost.set()
                self.lease_lost.set()
                return
        elif action.kind is ActionKind.FINALIZE:
            assert view.state is not None
            state = replace(view.state, phase="final", members=list(action.members),
                            completed_at=now)
            self._retry("finalize round", lambda: self.client.put_if(
                k.rdzv_state, state.to_json(), mod_revision=state_rev), deadline)
        elif action.kind is ActionKind.WAIT:
            if self.on_wait is not None:
                self.on_wait()
            until = action.until if action.until is not None else deadline
            self._view.wait_change(version, min(until - time.monotonic(), 1.0))
            return
        # A write happened (or lost a race): wait for the watch to show its effect.
        self._view.wait_change(version, 0.5)

    def _gc_before(self, round_: int) -> None:
        """Delete per-round keys two or more rounds old (their rounds are superseded)."""
        k = self.keys
        try:
            kvs, _ = self.client.get_prefix(k.store_root)
            stale_store = {key[: len(k.store_root) + 11] for key in (kv.key for kv in kvs)
                           if (r := round_of_key(key, k.store_root)) is not None and r < round_ - 1}
            for prefix in stale_store:
                self.client.delete_prefix(prefix)
            with self._view.cond:
                rdzv_keys = list(self._view.rdzv)
            for key in rdzv_keys:
                for root in (k.joins_root, k.failures_root):
                    r = round_of_key(key, root)
                    if r is not None and r < round_:
                        self.client.delete(key)
        except EtcdUnavailableError as exc:  # the next round's opener will retry
            self._log.warning("round_gc_failed", error=str(exc))

    def is_closed(self) -> bool:
        view, _ = self._view.snapshot()
        if view.closed:
            return True
        if not self._watches:
            try:
                return self.client.get(self.keys.rdzv_closed) is not None
            except EtcdUnavailableError:
                return False
        return False

    def set_closed(self) -> None:
        self._retry("close", lambda: self.client.put(self.keys.rdzv_closed, b"1"),
                    time.monotonic() + self.settings.close_timeout_s)

    def _outage_grace_s(self) -> float:
        return self.settings.node_ttl_s + 5.0

    def num_nodes_waiting(self) -> int:
        """Answered from the watch cache: no etcd request. See ``membership``."""
        return self.membership().count

    def membership(self) -> Waiting:
        """Who waits for this node to re-rendezvous, why, and the kind of change.

        Answered from the watch cache: no etcd request. See ``protocol.nodes_waiting``;
        ``kind`` is ``MembershipChange.JOIN`` when only newcomers wait (a scale-up the
        agent can drain for), ``LEASE_LOST`` when this node's own lease is gone.

        After an etcd outage every lease may expire at once (a frozen single-member etcd
        revokes them all when it resumes). Members lost right after this node itself saw
        etcd trouble get a grace period to re-register (``try_resurrect``) before the loss
        counts as a membership change (count 0 meanwhile).
        """
        if self.lease_lost.is_set():
            return Waiting(1, "this node's lease was lost", MembershipChange.LEASE_LOST)
        if self._round is None:
            return Waiting()
        view, _ = self._view.snapshot()
        waiting = nodes_waiting(view, self._round, max_nodes=self.settings.max_nodes)
        lost = lost_members(view.state, view.alive) if view.state and view.state.round == self._round else []
        with self._view.cond:
            lost = [m for m in lost if m not in self._view.left]  # a clean leave needs no grace
        if lost and self.client.trouble_within(self._outage_grace_s()):
            now = time.monotonic()
            self._loss_seen_at = self._loss_seen_at or now
            if now - self._loss_seen_at < self.settings.node_ttl_s + 2.0:
                return Waiting()
        elif not lost:
            self._loss_seen_at = None
        if waiting.count and waiting.reason != self._last_reason:
            self._log.info("membership_changed", reason=waiting.reason, kind=waiting.kind.value,
                           round=self._round)
            self._last_reason = waiting.reason
        return waiting

    def report_failure(self, detail: str) -> None:
        """Record that our workers failed in the current round (on our lease)."""
        if self._round is None or self.lease_lost.is_set():
            return
        key = self.keys.failure(self._round, self.node_id)
        call_with_retry(lambda: self.client.put(key, detail, lease=self.lease_id),
                        what="failure report", deadline=time.monotonic() + 5)

    def try_resurrect(self) -> bool:
        """Re-register after our lease expired because *etcd* was away, keeping our round.

        Allowed only if etcd failed or stalled recently as seen from here, and the job is
        still in our final round with us as a member: then nobody moved on, and the new
        lease (a new incarnation) simply replaces the old one. Otherwise we were the ones
        away (frozen, partitioned) and must rejoin as a new member.
        """
        if not self.lease_lost.is_set() or self._round is None:
            return False
        if not self.client.trouble_within(self._outage_grace_s()):
            return False
        view, _ = self._view.snapshot()
        state = view.state
        if state is None or state.round != self._round or state.phase != "final" \
                or self.node_id not in state.members:
            return False
        self._register(time.monotonic() + self.settings.join_timeout_s)
        self._lease_loss = None
        self._log.warning("lease_resurrected", round=self._round,
                          reason="lease expired during an etcd outage; same round")
        return True

    def pop_lease_loss(self) -> int | None:
        """The round we were in when our lease was found lost (once), or None."""
        lost, self._lease_loss = self._lease_loss, None
        return lost

    def view(self) -> RendezvousView:
        return self._view.snapshot()[0]

    def update_record(self, **changes: Any) -> None:
        """Rewrite our node record, fenced by our incarnation (no-op if the lease is gone).

        Raises:
            LeaseLostError: the node key is gone or belongs to a newer incarnation.
        """
        if self._record is None or self._keeper is None:
            return
        record = replace(self._record, heartbeat_at=time.time(), **changes)
        key = self.keys.node(self.node_id)
        ok, _ = self.client.txn(
            lambda t: [t.create(key) == self._incarnation],
            lambda t: [t.put(key, record.to_json(), lease=self.lease_id)],
        )
        if not ok:
            raise LeaseLostError(f"node record {key} is gone: lease expired")
        self._record = record

    def shutdown(self) -> bool:
        """Leave the job explicitly: revoke the lease so peers see us go at once."""
        if self._shutdown:
            return True
        self._shutdown = True
        if self._store is not None:
            self._store.close()
        if self._keeper is not None:
            self._keeper.stop(revoke=True)
        for w in self._watches:
            w.stop()
        self._log.info("rendezvous_left", round=self._round)
        return True


def _is_live_elasticd(pid: int) -> bool:
    """True if ``pid`` runs on this host and its command line names elasticd."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"elasticd" in fh.read()
    except OSError:
        return False
