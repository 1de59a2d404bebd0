"""``NodeSession``: this node's seat in the job: its lease, its record, its fencing token.

The node key ``nodes/<node>`` sits on the node's lease (kept alive by ``LeaseKeeper``);
its create_revision is this node's *incarnation*, the fencing token of every later
write: ``fence()`` is the compare that makes a write happen only while this incarnation
is the live one. The session also holds the round this node last completed (its
members and the round state's mod_revision then), which the rendezvous handler sets and
the agent's recorder reads: the recorder takes the session, not the whole handler.

This module does not import torch: an agent registers its session before it imports
torch (``elasticd.agent.boot``), and its rendezvous handler adopts it (``attach``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from elasticd import __version__
from elasticd.errors import ConfigError, EtcdUnavailableError, LeaseLostError, TransientError
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.kv import KV
from elasticd.etcd.lease import LeaseKeeper
from elasticd.etcd.txn import Compare, CreateRevision, Get, ModRevision, Put
from elasticd.keys import JobKeys
from elasticd.records import NodeRecord, RecordError, RoundState
from elasticd.rendezvous.liveness import LivenessListener
from elasticd.rendezvous.view import WatchedView
from elasticd.retry import call_with_retry

log = structlog.get_logger(__name__)


def retry_rdzv(what: str, fn: Callable[[], Any], deadline: float) -> Any:
    """``fn()`` retried on transient etcd errors until ``deadline`` (monotonic).

    Raises:
        RendezvousConnectionError: etcd stayed unreachable until the deadline (torch's
            agent reads this error as "the rendezvous backend is unavailable").
    """
    try:
        return call_with_retry(fn, what=what, deadline=deadline)
    except TransientError as exc:
        # Imported here: this module is used before the agent imports torch.
        from torch.distributed.elastic.rendezvous import RendezvousConnectionError

        raise RendezvousConnectionError(f"{what}: {exc}") from exc


class DuplicateNodeIdError(ConfigError):
    """A live agent holds this node id: on this host (its pid is a live elasticd
    process) or elsewhere (its lease kept alive past a full TTL). Certain, so the early
    arrival refuses it before the agent imports torch (exit 78)."""


class NodeSession:
    """One node's lease, node record and incarnation, and the round it last completed.

    Args:
        client: etcd client (not closed here).
        keys: the job's key builder.
        node_id: this node's id (validated by the caller).
        view: the handler's watched view (a retired key's expiry is awaited there).
        ttl_s: the lease's TTL.
        worker_log_dir: published in the node record, for ``elasticd status``.
        on_lease_lost: called (from the keep-alive thread) when the lease is found expired.
        liveness_probe: hold a liveness listener and publish it in the node record.
        local_addr: the node's advertised address (the listener binds there; every
            interface when None, and the record then names ``socket.getfqdn()``).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str, view: WatchedView, *,
                 ttl_s: int, worker_log_dir: str | None = None,
                 on_lease_lost: Callable[[], None] | None = None, liveness_probe: bool = False,
                 local_addr: str | None = None, fingerprint: str = "") -> None:
        self.client = client
        self.keys = keys
        self.node_id = node_id
        self.view = view
        self.ttl_s = ttl_s
        self.worker_log_dir = worker_log_dir
        self.on_lease_lost = on_lease_lost
        self.keeper: LeaseKeeper | None = None
        self.incarnation = 0  # create_revision of our node key: the fencing token
        self.record: NodeRecord | None = None
        self.round: int | None = None  # last round we completed
        self.members: tuple[str, ...] = ()
        self.state_rev = 0  # mod_revision of the state key when our round completed
        self.lease_loss: int | None = None  # round we were in when our lease was lost
        self.lease_lost = threading.Event()
        self.liveness_probe = liveness_probe
        self.local_addr = local_addr
        # Carried in every incarnation's record: a re-registration keeps the job held
        # (elasticd.agent.admission).
        self.fingerprint = fingerprint
        self.listener: LivenessListener | None = None
        self._closed = False
        # The round whose join key we put before the handler existed (agent.boot).
        self.early_join: int | None = None
        self._log = log.bind(job=keys.job, node=node_id)

    def attach(self, view: WatchedView, *, worker_log_dir: str | None,
               on_lease_lost: Callable[[], None] | None) -> None:
        """Hand a session registered early (before torch was imported) to a rendezvous
        handler: from now on our joins are checked against its view, and the record names
        the worker log dir once the agent rewrites it (its first state change)."""
        self.view = view
        self.on_lease_lost = on_lease_lost
        self.worker_log_dir = worker_log_dir
        if self.record is not None:
            self.record = replace(self.record, log_dir=worker_log_dir)
        with view.cond:
            view.lease_id = self.lease_id
        if self.early_join is not None:  # the handler's view knows our join is in
            view.add_own_join(self.early_join, self.lease_id)

    @property
    def lease_id(self) -> int:
        return self.keeper.lease_id if self.keeper else 0

    def fence(self) -> list[Compare]:
        """The compare that fences a write: our node key is still our incarnation."""
        return [CreateRevision(self.keys.node(self.node_id), self.incarnation)]

    # -- registration -------------------------------------------------------------------
    def ensure_registered(self, deadline: float) -> None:
        """Register unless our lease is known to be alive (asks etcd if unsure)."""
        if self.keeper is not None and not self.keeper.lost.is_set():
            # Our keep-alive thread may not have noticed yet (we were frozen): ask etcd.
            try:
                if self.client.refresh_lease(self.keeper.lease_id) <= 0:
                    self.keeper.lost.set()
                    self.lease_lost.set()
            except EtcdUnavailableError:
                pass  # etcd down: the join below retries, and the keeper keeps trying
        if self.keeper is None or self.keeper.lost.is_set():
            self.register(deadline)

    def register(self, deadline: float, *, round_rev: int | None = None) -> bool:
        """Grant a fresh lease and put our node record on it (a new incarnation).

        Args:
            round_rev: put the record only if the round state key's mod_revision is still
                this one (``resurrect``: nobody opened the next round meanwhile, as our
                possibly stale view claimed); otherwise revoke the fresh lease.

        Returns:
            False only when ``round_rev`` did not match (nothing registered).
        """
        if self.keeper is not None:
            if self.keeper.lost.is_set():
                self.lease_loss = self.round
                self._log.warning("lease_replaced", round=self.round)
            self.keeper.stop()
        key = self.keys.node(self.node_id)
        if self.record is None:
            # Before the lease grant: waiting out another machine's lease can take a TTL.
            self._retire_previous_process(key, deadline)
        lease = retry_rdzv("lease grant", lambda: self.client.grant_lease(self.ttl_s), deadline)
        if self.liveness_probe and self.listener is None:
            # One listener while the session lives: a re-registration keeps its port.
            try:
                self.listener = LivenessListener(self.local_addr)
            except OSError as exc:  # no port for it: peers fall back to our lease
                self._log.warning("liveness_probe_unavailable", error=str(exc))
                self.liveness_probe = False
        record = self.record or NodeRecord(
            node=self.node_id, host=socket.gethostname(), pid=os.getpid(), version=__version__,
            started_at=time.time(), log_dir=self.worker_log_dir,
        )
        record = replace(record, state="joining", heartbeat_at=time.time(),
                         probe_host=(self.local_addr or socket.getfqdn()) if self.listener else None,
                         probe_port=self.listener.port if self.listener else 0,
                         fingerprint=self.fingerprint)
        # The put and the read of our incarnation (the record's create_revision) in one
        # request: a round at 1,000 nodes is bound by etcd's requests (docs/benchmarks.md).
        guard = [] if round_rev is None else [ModRevision(self.keys.rdzv_state, round_rev)]
        put, reads = retry_rdzv("node record", lambda: self.client.txn_read(
            guard, [Put(key, record.to_json(), lease=lease), Get(key)]), deadline)
        if not put:
            try:
                self.client.revoke_lease(lease)
            except TransientError:  # it expires within a TTL anyway
                pass
            self._log.warning("lease_not_resurrected", round=self.round,
                              reason="the round state moved: the job re-formed during the outage")
            return False
        written = reads[0]  # the Get after our put: never None
        self.incarnation = written.create_revision if written else 0
        self.record = record
        with self.view.cond:  # joins put on an older lease died with it
            self.view.lease_id = lease
        self.lease_lost.clear()
        self.keeper = LeaseKeeper(self.client, lease, self.ttl_s, on_lost=self._keeper_lost).start()
        self._log.info("node_registered", lease=hex(lease), incarnation=self.incarnation)
        return True

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
        old = retry_rdzv("node record", lambda: self.client.get(key), deadline)
        if old is None:
            return
        old = self._refuse_live_duplicate(key, old, deadline)
        if old is None:
            return
        state = self.view.snapshot()[0].state
        if state is None:  # registering early: the handler's watches do not run yet
            state = self._read_state(deadline)
        if state is not None and state.phase == "final" and self.node_id in state.members:
            self.round = state.round
        retry_rdzv("node record", lambda: self.client.delete(key), deadline)
        self._log.warning("previous_process_retired", old_lease=hex(old.lease), round=self.round)

    def _read_state(self, deadline: float) -> RoundState | None:
        kv = retry_rdzv("round state", lambda: self.client.get(self.keys.rdzv_state), deadline)
        try:
            return RoundState.from_json(kv.value) if kv is not None else None
        except RecordError:
            return None

    def _refuse_live_duplicate(self, key: str, old: KV, deadline: float) -> KV | None:
        """Raise ConfigError if ``old`` belongs to a live agent; else return it (or None
        if it expired meanwhile)."""
        try:
            rec = NodeRecord.from_json(old.value)
        except (ValueError, TypeError):
            return old  # not a record we wrote: retire it
        fix = (f"node id {self.node_id!r} is already used by a live elasticd agent "
               f"(host {rec.host}, pid {rec.pid}); every agent needs its own node id: two "
               "agents on one host need --node-id a / --node-id b (node.id)")
        if rec.host == socket.gethostname():
            if rec.pid != os.getpid() and _is_live_elasticd(rec.pid):
                raise DuplicateNodeIdError(fix)
            return old  # our own previous process, now dead: retire it at once
        # Another machine: a vanished one's lease runs out within one TTL (and etcd's
        # expiry loop); a live duplicate keeps it.
        until = min(deadline, time.monotonic() + self.ttl_s + 2.0)
        self._log.warning("node_id_held_elsewhere", host=rec.host, pid=rec.pid,
                          wait_s=round(until - time.monotonic(), 1))
        while (left := until - time.monotonic()) > 0:
            # Polled (a rare path): only the coordinator watches nodes/.
            cur = retry_rdzv("node record", lambda: self.client.get(key), deadline)
            if cur is None or cur.create_revision != old.create_revision:
                return cur
            time.sleep(min(left, 0.25))
        # Past a full TTL the lease is kept alive: certain. Cut short by the deadline: a
        # vanished machine's lease may still run out (the handler, later, waits it out).
        full_ttl = until < deadline
        raise DuplicateNodeIdError(fix) if full_ttl else ConfigError(fix)

    def _keeper_lost(self) -> None:
        self.lease_lost.set()
        self.view.touch()
        if self.on_lease_lost:
            self.on_lease_lost()

    def mark_lease_lost(self) -> None:
        """etcd refused a write on our lease before the keep-alive thread noticed."""
        if self.keeper is not None:
            self.keeper.lost.set()
        self.lease_lost.set()

    def pop_lease_loss(self) -> int | None:
        """The round we were in when our lease was found lost (once), or None."""
        lost, self.lease_loss = self.lease_loss, None
        return lost

    # -- fenced writes ------------------------------------------------------------------
    def update_record(self, **changes: Any) -> None:
        """Rewrite our node record, fenced by our incarnation (no-op if the lease is gone).

        Raises:
            LeaseLostError: the node key is gone or belongs to a newer incarnation.
        """
        if self.record is None or self.keeper is None:
            return
        record = replace(self.record, heartbeat_at=time.time(), **changes)
        key = self.keys.node(self.node_id)
        if not self.client.txn(self.fence(), [Put(key, record.to_json(), lease=self.lease_id)]):
            raise LeaseLostError(f"node record {key} is gone: lease expired")
        self.record = record

    def report_failure(self, detail: str) -> None:
        """Record that our workers failed in the current round (on our lease)."""
        if self.round is None or self.lease_lost.is_set():
            return
        rnd, lease = self.round, self.lease_id
        key = self.keys.failure(rnd, self.node_id)
        call_with_retry(lambda: self.client.put(key, detail, lease=lease),
                        what="failure report", deadline=time.monotonic() + 5)
        self.view.add_own_failure(rnd, lease)

    def record_leave(self, kind: str | None) -> None:
        """Write ``left/<round>/<node>`` = ``kind`` (best effort) before the lease goes."""
        rnd = self.round
        if kind is None or rnd is None or self.keeper is None or self.lease_lost.is_set():
            return  # never in a round, or already taken for lost: nothing to correct
        try:
            # Not on our lease: it must outlive the revoke below. Removed with the round's
            # other keys when a later round opens (``_gc_before``) or the job is reopened.
            call_with_retry(lambda: self.client.put(self.keys.left(rnd, self.node_id), kind),
                            what="leave record", deadline=time.monotonic() + 3.0)
            self._log.info("leave_recorded", round=rnd, kind=kind)
        except TransientError as exc:  # peers will read a lost member: a re-form, as before
            self._log.warning("leave_not_recorded", round=rnd, kind=kind, error=str(exc))

    def close(self) -> None:
        """Stop the keep-alives and revoke the lease: peers see this node go at once.
        Idempotent (the early arrival and the handler may both close it)."""
        if self._closed:
            return
        self._closed = True
        if self.keeper is not None:
            self.keeper.stop(revoke=True)
        if self.listener is not None:  # after the revoke: peers see a leave, then nothing
            self.listener.close()
            self.listener = None


def _is_live_elasticd(pid: int) -> bool:
    """True if ``pid`` runs on this host and its command line names elasticd."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"elasticd" in fh.read()
    except OSError:
        return False
