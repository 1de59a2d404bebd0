"""``EtcdRendezvousHandler``: torch elastic's rendezvous on etcd v3 primitives.

- Liveness is a lease per node, kept alive by ``LeaseKeeper`` (O(1) per node per
  keep-alive, no shared blob rewritten). The node key ``nodes/<node>`` sits on it; its
  create_revision is this node's *incarnation*, the fencing token of every later write.
  ``NodeSession`` (session.py) holds the lease, the record and that token.
- Every state change is a transaction comparing the state key's mod_revision; the
  decisions are pure functions in ``protocol.py``.
- Watches keep a local view (``WatchedView``, view.py), so ``num_nodes_waiting()`` and
  ``membership()`` cost no etcd request. Every node watches ``rdzv/`` but its joins; one
  node, the coordinator (coordinator.py), also watches ``nodes/`` and every join, closes
  rounds and opens the next one when a member is lost, leaves or a joiner waits (a dead
  peer is noticed when its lease expires, not when a gloo/NCCL timeout fires minutes
  later). So a round costs O(N) watch events, not O(N^2).
- An unreachable etcd is not a dead peer: while etcd is down the view does not change,
  so healthy workers keep training; calls are retried with backoff.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import structlog
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousTimeoutError,
)

from elasticd.errors import EtcdUnavailableError, LeaseLostError
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.txn import DeleteRange, Op
from elasticd.etcd.watch import PrefixWatch
from elasticd.keys import JobKeys
from elasticd.records import ClosedRecord, RoundState
from elasticd.rendezvous.coordinator import RoundCoordinator
from elasticd.rendezvous.etcd_store import EtcdStore
from elasticd.rendezvous.finished import FinishedJob, finished_job, finished_notice
from elasticd.rendezvous.liveness import MemberProbes, PeerProber, ProbeTarget
from elasticd.rendezvous.outage import loss_grace, may_resurrect, outage_window_s, presumed_outage
from elasticd.rendezvous.protocol import (
    LEFT_FINISHED,
    Action,
    ActionKind,
    JoinProgress,
    MembershipChange,
    RendezvousView,
    Waiting,
    decide_join,
    departures,
    dropped_members,
    is_spare,
    nodes_waiting,
    spare_reason,
)
from elasticd.rendezvous.session import NodeSession, retry_rdzv
from elasticd.rendezvous.settings import RendezvousSettings, default_node_id
from elasticd.rendezvous.stragglers import StragglerWatch
from elasticd.rendezvous.view import WatchedView

log = structlog.get_logger(__name__)


class JobFinishedError(RendezvousClosedError):
    """This node arrived at a job that had finished: it must not run it again.

    ``finished`` says when and at which step; the message ends with how to reopen it.
    """

    def __init__(self, message: str, finished: FinishedJob) -> None:
        super().__init__(message)
        self.finished = finished


def step_is_news(action: Action, view: RendezvousView, node_id: str, max_nodes: int) -> bool:
    """Whether a join step is logged at info: waiting (for nodes, for the last call) is what
    an operator looks for when a job does not start; the other steps of a round are chatter,
    and so is a one-node job's wait for its own coordinator thread, which closes the round as
    soon as we joined (seen on a busy machine, when that thread was a moment behind the
    handler's: the standalone quick start's first log line)."""
    alone = max_nodes == 1 and view.coordinator == node_id
    return action.kind is ActionKind.WAIT and not alone


class EtcdRendezvousHandler(RendezvousHandler):
    """A torch elastic ``RendezvousHandler`` on etcd v3 (backend name ``etcd-v3``).

    Args:
        client: etcd client. The caller closes it after ``shutdown``, unless it passes
            ``owns_client=True`` (torchrun's path, ``registry.create_handler``, where
            nobody else holds it): then ``shutdown`` closes it.
        job: job name (the run id); keys live under ``/elasticd/<job>/``.
        settings: sizes and timeouts.
        node_id: this node's id; ``<host>-<pid>`` by default.
        on_lease_lost: called (from the keep-alive thread) when this node's lease is found
            expired, i.e. the node was frozen or cut off longer than its TTL.
        session: a ``NodeSession`` registered before torch was imported
            (``elasticd.agent.boot``): adopted, with its node id, lease and incarnation,
            instead of registering anew. It must use ``client`` and ``settings``' TTL.
    """

    def __init__(self, client: EtcdClient, job: str, settings: RendezvousSettings, *,
                 node_id: str | None = None,
                 on_lease_lost: Callable[[], None] | None = None,
                 owns_client: bool = False, session: NodeSession | None = None) -> None:
        self.client = client
        self._owns_client = owns_client
        self.keys = JobKeys(job)
        self.settings = settings
        self.node_id = session.node_id if session is not None else (node_id or default_node_id())
        self.keys.node(self.node_id)  # validates the id
        self._view = WatchedView(self.keys, self.node_id)
        self._watches: list[PrefixWatch] = []
        self._coordinator: RoundCoordinator | None = None
        self._coord_loss_seen_at: float | None = None  # the coordinator's outage grace
        # Our lease, record and incarnation (the fencing token), and the round we completed.
        if session is not None:  # registered early, while torch was being imported
            session.attach(self._view, worker_log_dir=settings.worker_log_dir,
                           on_lease_lost=on_lease_lost)
            self.session = session
        else:
            self.session = NodeSession(client, self.keys, self.node_id, self._view,
                                       ttl_s=settings.node_ttl_s,
                                       worker_log_dir=settings.worker_log_dir,
                                       on_lease_lost=on_lease_lost,
                                       liveness_probe=settings.liveness_probe,
                                       local_addr=settings.local_addr,
                                       fingerprint=settings.fingerprint)
        # Proves stragglers and peers gone before their lease expires (liveness.py).
        self.prober = PeerProber(on_dead=self._view.touch) if settings.liveness_probe else None
        self._member_probes = MemberProbes(self.prober, self._member_targets)
        self._loss_seen_at: float | None = None  # first sight of lost members after an outage
        self._store: EtcdStore | None = None
        self._last_reason = ""
        self._shutdown = False
        self._arrival_checked = False  # the finished-job check of our first rendezvous
        # Set (plain assignment, safe from a signal handler) when this node must stop:
        # next_rendezvous then raises RendezvousGracefulExitError within a second.
        self.stop_requested: str | None = None
        self.rendezvous_s = 0.0
        # Called while waiting for a round (e.g. the systemd watchdog ping of the agent).
        self.on_wait: Callable[[], None] | None = None
        # Called with the members whose lease expired when we open the next round for it.
        self.on_members_lost: Callable[[list[str], int], None] | None = None
        # Called once (with the deadline) after our first registration and before we join
        # or coordinate anything: the agent's admission (elasticd.agent.admission), which
        # raises to refuse this node.
        self.on_registered: Callable[[float], None] | None = None
        # Called with True when this node starts waiting as a hot spare (the job is full
        # without it), False when it is admitted or stops waiting (metrics).
        self.on_spare: Callable[[bool], None] | None = None
        # Called (from the coordinator's thread) with the members flagged as stragglers,
        # node -> own step time / the median's, whenever that set changes.
        self.on_stragglers: Callable[[dict[str, float]], None] | None = None
        self.spare = False
        self._admitted = False
        # How ``shutdown`` tells the others we went (``left/<round>/<node>``): torch's
        # launch_agent calls shutdown() only once the node is done for good (its workers
        # finished, or failed past the budget), as torch's own backends read it ("closes
        # the rendezvous"). elasticd's agent sets "drained" when it leaves a running job
        # and None when it gives up (the others then see a lost member, as before).
        self.leave_kind: str | None = LEFT_FINISHED
        self._finishing = threading.Event()  # mark_finished: our coordinator opens no round
        self.closed_written = False  # mark_finished wrote rdzv/closed
        self._log = log.bind(job=job, node=self.node_id)

    # -- lifecycle ----------------------------------------------------------------------
    def _ensure_started(self, deadline: float) -> None:
        if not self._watches:
            # One plain read first: bad TLS files or credentials surface as ConfigError now
            # (watches would retry them silently until join_timeout), and an unreachable etcd
            # is reported with gRPC's reason.
            retry_rdzv("connect to etcd", lambda: self.client.get(self.keys.rdzv_state), deadline)
            k = self.keys
            # rdzv/ but rdzv/failures/ and rdzv/joins/ (adjacent: nothing sorts between
            # them): [rdzv/, rdzv/failures/) and [rdzv/joins0, rdzv0).
            self._watches = [
                self.client.watch_prefix(k.rdzv_prefix, self._view.on_rdzv,
                                         self._view.on_rdzv_resync, name="rdzv",
                                         range_end=k.failures_root),
                self.client.watch_prefix(_prefix_end(k.joins_root), self._view.on_rdzv_hi,
                                         self._view.on_rdzv_hi_resync, name="rdzv-hi",
                                         range_end=_prefix_end(k.rdzv_prefix)),
            ]
            for w in self._watches:
                if not w.connected.wait(max(deadline - time.monotonic(), 0.1)):
                    raise RendezvousConnectionError(
                        f"cannot watch etcd at {self.client.endpoint_label()}: is it running?"
                    )
        if not self._arrival_checked:
            # Before we register: a finished job is never reopened by a node that merely
            # (re)started; `elasticd start` does that (issue 25). The boot sequence's
            # FINISHED check after the torch import (elasticd.agent.boot).
            self._refuse_finished_job(deadline)
            self._arrival_checked = True
        self.session.ensure_registered(deadline)
        if not self._admitted and self.on_registered is not None:
            self.on_registered(deadline)
        self._admitted = True
        if self._coordinator is None:
            s = self.settings
            self._coordinator = RoundCoordinator(
                self.client, self.keys, self.session, self._view, min_nodes=s.min_nodes,
                max_nodes=s.max_nodes, valid_sizes=s.valid_sizes,
                last_call_timeout_s=s.last_call_timeout_s,
                start_settle_s=s.start_settle_s,
                finalize=lambda a, v, rev: self._finalize(a, v, rev, time.monotonic() + 10.0),
                open_next=lambda a, v, rev, extra=(): self._open_next(
                    a, v, rev, time.monotonic() + 10.0, extra_ops=extra),
                defer_lost_until=self._defer_lost_until,
                hold_previous_until=self._hold_previous_until, prober=self.prober,
                holder_probes=MemberProbes(self.prober, self._member_targets),
                finishing=self._finishing, hang_eject_s=s.hang_eject_s,
                stragglers=(StragglerWatch(s.straggler_factor, s.straggler_window_s)
                            if s.straggler_factor > 0 else None),
                straggler_probation_s=s.straggler_probation_s,
                on_stragglers=lambda flagged: self.on_stragglers(flagged)
                if self.on_stragglers is not None else None).start()

    def _refuse_finished_job(self, deadline: float) -> None:
        """A node arriving at a finished job does not run it again (``finished.py``).

        Raises:
            JobFinishedError: ``rdzv/closed`` exists; the message says when the job
                finished, at which step, and that ``elasticd start`` reopens it.
        """
        closed = self._view.rdzv_get(self.keys.rdzv_closed)
        if closed is None:
            return
        progress = retry_rdzv("read progress", lambda: self.client.get(self.keys.progress),
                              deadline)
        finished = finished_job(self.keys.job, closed.value,
                                progress.value if progress is not None else None)
        reason, fix = finished_notice(finished)
        raise JobFinishedError(f"{reason}; {fix}", finished)

    def arrive(self) -> None:
        """Register now (watches, the finished-job check, our lease and record, the
        coordinator's campaign), before the agent waits for anything slow: a node that
        holds a lease holds the last call of an open round (the start race, issue 25).
        ``next_rendezvous`` does the same first; calling both is harmless.

        Raises:
            JobFinishedError: the job had finished.
            RendezvousConnectionError: etcd stayed unreachable for ``join_timeout_s``.
        """
        self._ensure_started(time.monotonic() + self.settings.join_timeout_s)

    # -- the session's state, for the agent ------------------------------------------------
    @property
    def lease_id(self) -> int:
        return self.session.lease_id

    @property
    def lease_lost(self) -> threading.Event:
        """Set once this node's lease is found expired; cleared when it re-registers."""
        return self.session.lease_lost

    @property
    def incarnation(self) -> int:
        """create_revision of this node's key: the fencing token of its writes."""
        return self.session.incarnation

    @property
    def round(self) -> int | None:
        return self.session.round

    @property
    def round_state_revision(self) -> int:
        """mod_revision of the round state key when our round completed (the round fence)."""
        return self.session.state_rev

    @property
    def members(self) -> tuple[str, ...]:
        return self.session.members

    def pop_lease_loss(self) -> int | None:
        """The round we were in when our lease was found lost (once), or None."""
        return self.session.pop_lease_loss()

    def update_record(self, **changes: Any) -> None:
        """Rewrite our node record, fenced by our incarnation; see ``NodeSession``.

        Raises:
            LeaseLostError: the node key is gone or belongs to a newer incarnation.
        """
        self.session.update_record(**changes)

    def report_failure(self, detail: str) -> None:
        """Record that our workers failed in the current round (on our lease)."""
        self.session.report_failure(detail)

    def probe_members(self) -> frozenset[str]:
        """Members of our round that a liveness probe proved gone (their lease may still
        run). Non-blocking; see ``liveness.MemberProbes``."""
        if self.session.round is None:
            return frozenset()
        return self._member_probes.proven_dead(
            [m for m in self.session.members if m != self.node_id])

    def _member_targets(self, members: list[str]) -> list[ProbeTarget]:
        """Probe targets of ``members`` from their records, read from etcd (only the
        coordinator watches ``nodes/``)."""
        # No record: its lease is gone, and the membership change is seen anyway.
        return [t for m in members
                if (t := ProbeTarget.of_record(m, self.client.get(self.keys.node(m)))) is not None]

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
        progress = JoinProgress(self.node_id, self.session.round, deadline)
        while True:
            if self.stop_requested:
                raise RendezvousGracefulExitError(
                    f"job {self.keys.job!r}: {self.stop_requested} while waiting for a round")
            if self.lease_lost.is_set():
                self.session.register(deadline)
            view, state_rev = self._view.snapshot()
            version = self._view.version
            on_probation = view.probation.get(self.node_id)
            if ((on_probation or is_spare(view.state, self.node_id, self.settings.max_nodes,
                                          self.settings.valid_sizes))
                    and view.state is not None and self.client.unreachable() is None):
                # A spare waits as long as the job runs (protocol.is_spare): its join
                # deadline restarts while the job stays full without it and etcd answers
                # (an etcd gone for good still ends the wait, as for any joiner). So does
                # a straggler on probation (``rdzv/probation/``), until its lease ends.
                deadline = progress.deadline = time.monotonic() + self.settings.join_timeout_s
                self._set_spare(True, on_probation or spare_reason(
                    len(view.state.members), self.settings.max_nodes, self.settings.valid_sizes))
            proven = (self._view.proven_dead(self.prober.dead())
                      if self.prober is not None and view.full else frozenset())
            action = decide_join(view, progress, min_nodes=self.settings.min_nodes,
                                 max_nodes=self.settings.max_nodes,
                                 valid_sizes=self.settings.valid_sizes,
                                 last_call_timeout_s=self.settings.last_call_timeout_s,
                                 now=time.monotonic(), proven_dead=proven,
                                 start_settle_s=self.settings.start_settle_s,
                                 defer_lost_until=self._defer_lost_until(view)
                                 if view.full and view.state is not None else None,
                                 hold_previous_until=self._hold_previous_until()
                                 if view.full else None)
            if action.probe and self.prober is not None:
                due = self.prober.request(self._view.probe_targets(action.probe))
                if due is not None and action.until is not None:
                    action = replace(action, until=min(action.until, due))
            if action.reason != self._last_reason:
                news = step_is_news(action, view, self.node_id, self.settings.max_nodes)
                log_step = self._log.info if news else self._log.debug
                log_step("rendezvous_step", action=action.kind.value, reason=action.reason)
                self._last_reason = action.reason
            if action.kind is ActionKind.DONE:
                self.session.state_rev = state_rev
                self._set_spare(False)
                break
            self._execute(action, view, state_rev, version, deadline)
        rank = action.members.index(self.node_id)
        self.session.round = action.round
        self.session.members = action.members
        formed = action.round
        store = EtcdStore(self.client, self.keys.store_prefix(formed),
                          timeout_s=self.settings.store_timeout_s,
                          abandoned=lambda: self.round_abandoned(formed))
        self._store = store
        bootstrap = store.bootstrap_info(rank, self.settings.local_addr)
        self.rendezvous_s = time.monotonic() - start
        # nnodes: nodes in the round (torch's "world size" of a rendezvous); the workers'
        # world size is nnodes x nproc_per_node.
        self._log.info("rendezvous_completed", round=action.round, rank=rank,
                       nnodes=len(action.members), members=list(action.members),
                       seconds=round(self.rendezvous_s, 3))
        return RendezvousInfo(store, rank, len(action.members), bootstrap)

    def round_abandoned(self, round_: int) -> str:
        """Why round ``round_`` can no longer complete, or ``""``: a newer round superseded
        it, or a member of it (not us) left or was lost. Asked by the round's store while a
        read blocks on the other members (torch's rank exchange)."""
        view, _ = self._view.snapshot()
        state = view.state
        if state is None or state.round < round_:
            return ""
        if state.round > round_:
            return f"round {state.round} superseded round {round_}"
        if state.phase != "final":
            return ""
        gone = departures(view, state)
        lost = [m for m in gone.lost if m != self.node_id]
        drained = [m for m in gone.drained if m != self.node_id]
        if lost:
            return f"round {round_} lost {','.join(lost)}"
        if drained:
            return f"{','.join(drained)} left round {round_}"
        return ""

    def _set_spare(self, spare: bool, reason: str = "") -> None:
        """Say (once per change) that this node waits as a hot spare (and why: ``reason``,
        shown by ``status``), or no longer does."""
        if spare == self.spare:
            return
        self.spare = spare
        if spare:
            self._log.info("spare_waiting", reason=f"{reason}: admitted when a member is lost "
                           "or drained")
            try:
                self.session.update_record(state="spare", spare_reason=reason)
            except (LeaseLostError, EtcdUnavailableError) as exc:  # shown on the next write
                self._log.debug("spare_record_not_written", error=str(exc))
        else:
            self._log.info("spare_admitted")
        if self.on_spare is not None:
            self.on_spare(spare)

    def _execute(self, action: Action, view: RendezvousView, state_rev: int, version: int,
                 deadline: float) -> None:
        s, k = self.settings, self.keys
        if action.kind is ActionKind.CLOSED:
            raise RendezvousClosedError(f"job {k.job!r} is closed ({action.reason})")
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
            retry_rdzv("open round", lambda: self.client.put_if(k.rdzv_state, state.to_json(),
                                                                 mod_revision=0), deadline)
        elif action.kind is ActionKind.OPEN_NEXT:
            self._open_next(action, view, state_rev, deadline)
        elif action.kind is ActionKind.JOIN:
            lease = self.lease_id
            try:
                retry_rdzv("join", lambda: self.client.put(k.join(action.round, self.node_id), b"1",
                                                            lease=lease), deadline)
            except LeaseLostError:
                # Our lease expired before the keep-alive thread noticed: re-register
                # (a new incarnation) at the top of the loop, then join.
                self.session.mark_lease_lost()
                return
            self._view.add_own_join(action.round, lease)
        elif action.kind is ActionKind.FINALIZE:
            self._finalize(action, view, state_rev, deadline)
        elif action.kind is ActionKind.WAIT:
            if self.on_wait is not None:
                self.on_wait()
            until = action.until if action.until is not None else deadline
            self._view.wait_change(version, min(until - time.monotonic(), 1.0))
            return
        # A write happened (or lost a race): wait for the watch to show its effect.
        self._view.wait_change(version, 0.5)

    def _finalize(self, action: Action, view: RendezvousView, state_rev: int, deadline: float) -> bool:
        """CAS open(r) -> final(r, members). True if this write won."""
        assert view.state is not None
        state = replace(view.state, phase="final", members=list(action.members),
                        completed_at=time.time())
        won = bool(retry_rdzv("finalize round", lambda: self.client.put_if(
            self.keys.rdzv_state, state.to_json(), mod_revision=state_rev), deadline))
        if won:
            # One line per round closed, by whichever of the coordinator's two paths closed
            # it (its thread, or its own join with the full view): a loaded soak's fresh run
            # closed round 0 on the join path and the log had no line for it.
            self._log.info("coordinator_step", action=ActionKind.FINALIZE.value, reason=action.reason)
        dropped = dropped_members(view, view.state, action.members) if won else ()
        if dropped and self.on_members_lost is not None:
            self.on_members_lost(list(dropped), view.state.round - 1)
        return won

    def _open_next(self, action: Action, view: RendezvousView, state_rev: int, deadline: float,
                   extra_ops: Sequence[Op] = ()) -> bool:
        """CAS final(r) -> open(r+1), carrying the cause, and ``extra_ops`` in the same
        transaction (a straggler's probation); the winner reports lost members and
        deletes old rounds' keys. True if this write won."""
        assert view.state is not None
        s = self.settings
        state = RoundState(action.round, "open", list(view.state.members), s.min_nodes,
                           s.max_nodes, opened_at=time.time(), cause=action.cause,
                           changed=list(action.changed))
        if not retry_rdzv("open round", lambda: self.client.put_if(
                self.keys.rdzv_state, state.to_json(), mod_revision=state_rev,
                extra_ops=extra_ops), deadline):
            return False
        self._log.info("round_opened", round=action.round, reason=action.reason)
        lost = list(departures(view, view.state).lost)
        if lost and self.on_members_lost is not None:
            self.on_members_lost(lost, view.state.round)
        self._gc_before(action.round)
        return True

    def _gc_before(self, round_: int) -> None:
        """Delete per-round keys of superseded rounds: the store two or more rounds old,
        joins/failures/left of rounds before ``round_``. Key-range deletes: O(1) requests."""
        k = self.keys
        ranges = [(k.store_root, k.store_prefix(max(round_ - 1, 0)))]
        ranges += [(root, f"{root}{round_:010d}/") for root in (k.joins_root, k.failures_root,
                                                                  k.left_root)]
        try:
            self.client.txn([], [DeleteRange(start, end) for start, end in ranges])
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
        """Mark the job finished (``rdzv/closed``, a ``ClosedRecord``): every node that
        arrives later exits without joining until ``elasticd start`` reopens it."""
        record = ClosedRecord(finished_at=time.time(), node=self.node_id,
                              round=self.session.round if self.session.round is not None else -1)
        retry_rdzv("close", lambda: self.client.put(self.keys.rdzv_closed, record.to_json()),
                    time.monotonic() + self.settings.close_timeout_s)

    def mark_finished(self) -> bool:
        """Our workers completed the job: close it now, before the agent flushes its
        checkpoint commits and passes torch's exit barrier (seconds, up to
        ``drain_grace_s`` while etcd is slow).

        Why: until the close is written, a member whose lease was lost while it finished
        reads as lost, and the coordinator would open a round for late joiners that
        retrains the finished job from the last committed checkpoint (soak seed 777000:
        round 6 "members lost: n2", steps 200-239 trained again). Our coordinator stops
        opening rounds at once; the close then stops everyone else's.

        Returns:
            True if ``rdzv/closed`` was written; False if etcd did not answer within
            ``close_timeout_s`` (the caller writes it again before it exits).
        """
        self.leave_kind = LEFT_FINISHED
        self._finishing.set()
        self._view.touch()  # wake our coordinator: it must not act on a stale decision
        try:
            self.set_closed()
        except RendezvousConnectionError as exc:
            self._log.warning("job_close_deferred", error=str(exc))
            return False
        self.closed_written = True
        self._log.info("job_closed", round=self.session.round)
        return True

    def _etcd_trouble(self) -> bool:
        """This node saw etcd fail or stall recently enough to explain expired leases
        (an outage may include a leader election: ``outage.outage_window_s``)."""
        return self.client.trouble_within(outage_window_s(self.settings.node_ttl_s,
                                                          self.settings.election_timeout_s))

    def _defer_lost_until(self, view: RendezvousView) -> float | None:
        """For the coordinator: until when lost members are presumed victims of an etcd
        outage (they may re-register, ``try_resurrect``): ``outage.loss_grace``, as
        ``membership`` applies it."""
        lost = list(departures(view, view.state).lost) if view.state is not None else []
        with self._view.cond:
            lost = [m for m in lost if m not in self._view.left]
        outage = presumed_outage(lost, view.state, saw_trouble=bool(lost) and self._etcd_trouble())
        trouble_at = self.client.last_trouble_at
        grace = loss_grace(lost, etcd_trouble=outage, loss_seen_at=self._coord_loss_seen_at,
                           now=time.monotonic(), node_ttl_s=self.settings.node_ttl_s,
                           trouble_at=trouble_at)
        self._coord_loss_seen_at = grace.loss_seen_at
        if not grace.hold or grace.loss_seen_at is None:
            return None
        return max(grace.loss_seen_at, trouble_at) + self.settings.node_ttl_s + 2.0

    def _hold_previous_until(self) -> float | None:
        """For the coordinator: until when an open round's last call waits for members of
        the previous round, after etcd trouble seen here (``protocol._close_open_round``):
        they may still be reconnecting, as the lost ones may still re-register."""
        if not self._etcd_trouble():
            return None
        return self.client.last_trouble_at + self.settings.node_ttl_s + 2.0

    def num_nodes_waiting(self) -> int:
        """Answered from the watch cache: no etcd request. See ``membership``."""
        return self.membership().count

    def asked_to_drain(self) -> str:
        """Why the coordinator put this node on probation (a straggler) while it is a member
        of the final round it trains in: its agent drains the workers at the next agreed
        step, then waits as a spare. "" otherwise. From the watch cache: no etcd request."""
        my_round = self.session.round
        view, _ = self._view.snapshot()
        state = view.state
        if (my_round is None or state is None or state.round != my_round or state.phase != "final"
                or self.node_id not in state.members):
            return ""
        return view.probation.get(self.node_id, "")

    def membership(self) -> Waiting:
        """Who waits for this node to re-rendezvous, why, and the kind of change.

        Answered from the watch cache: no etcd request. See ``protocol.nodes_waiting``;
        ``kind`` is ``MembershipChange.JOIN`` when only newcomers wait (a scale-up the
        agent can drain for), ``LEASE_LOST`` when this node's own lease is gone.

        After an etcd outage every lease may expire at once (a frozen single-member etcd
        revokes them all when it resumes). Members lost right after this node itself saw
        etcd trouble get a grace period to re-register (``try_resurrect``) before the loss
        counts as a membership change (count 0 meanwhile): ``outage.loss_grace``.
        """
        if self.lease_lost.is_set():
            return Waiting(1, "this node's lease was lost", MembershipChange.LEASE_LOST)
        my_round = self.session.round
        if my_round is None:
            return Waiting()
        view, _ = self._view.snapshot()
        waiting = nodes_waiting(view, my_round, max_nodes=self.settings.max_nodes,
                                valid_sizes=self.settings.valid_sizes)
        lost = (list(departures(view, view.state).lost)
                if view.state and view.state.round == my_round else [])
        with self._view.cond:
            lost = [m for m in lost if m not in self._view.left]  # a clean leave needs no grace
        grace = loss_grace(lost, etcd_trouble=bool(lost) and self._etcd_trouble(),
                           loss_seen_at=self._loss_seen_at, now=time.monotonic(),
                           node_ttl_s=self.settings.node_ttl_s,
                           trouble_at=self.client.last_trouble_at)
        self._loss_seen_at = grace.loss_seen_at
        if grace.hold:
            return Waiting()
        if waiting.count and waiting.reason != self._last_reason:
            self._log.info("membership_changed", reason=waiting.reason, kind=waiting.kind.value,
                           round=my_round)
            self._last_reason = waiting.reason
        return waiting

    def try_resurrect(self) -> bool:
        """Re-register after our lease expired because *etcd* was away, keeping our round.

        The decision is ``outage.may_resurrect``: only after etcd trouble seen from
        here, and only while the job is still in our final round with us as a member;
        the re-registration itself compares the round state's mod_revision, so a round
        opened while our view was stale wins.

        Returns:
            True if this node re-registered in its round (its workers may go on).
        """
        my_round = self.session.round
        trouble = self._etcd_trouble()
        view, state_rev = self._view.snapshot()
        allowed, reason = may_resurrect(view.state, my_round, self.node_id,
                                        lease_lost=self.lease_lost.is_set(), etcd_trouble=trouble)
        if not allowed:
            if trouble and my_round is not None and self.lease_lost.is_set():
                # Lost to etcd's outage, but a round was opened meanwhile (soak seed 74008:
                # a node that saw its peer die opened one the moment etcd was back): we
                # rejoin as a new member, as when the re-registration's compare fails.
                self._log.warning("lease_not_resurrected", round=my_round, reason=reason)
            return False
        # Fenced by the round state we decided on: our view may be stale (etcd just came
        # back), and a node that saw the loss may have opened or closed the next round
        # meanwhile; re-registering in the old round then let our workers train on beside
        # the new one (the soak).
        if not self.session.register(time.monotonic() + self.settings.join_timeout_s,
                                     round_rev=state_rev):
            return False
        self.session.lease_loss = None
        self._log.warning("lease_resurrected", round=my_round, reason=reason)
        return True

    def view(self) -> RendezvousView:
        return self._view.snapshot()[0]

    def on_view_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (from the watch thread; it must not block) after every change
        the watches bring: the agent wakes its tick with it instead of polling."""
        self._view.listeners.append(listener)

    def shutdown(self) -> bool:
        """Leave the job explicitly: revoke the lease so peers see us go at once.

        First (if ``leave_kind`` is set and we completed a round) records the leave as
        ``left/<round>/<node>``, so peers read a leave, not a lost member: a *finished*
        node does not make the slower ones kill their healthy workers and wait for a
        round that never completes (torch's ``workers_drift_fail`` case).
        """
        if self._shutdown:
            return True
        self._shutdown = True
        if self._store is not None:
            self._store.close()
        if self._coordinator is not None:
            self._coordinator.stop()  # before the revoke: it must not campaign again
        self.session.record_leave(self.leave_kind)
        self.session.close()
        for w in self._watches:
            w.stop()
        if self._owns_client:
            # Its channel and threads would outlive us (and gRPC warns "skipping fork()
            # handlers" on every later fork); a client the caller passed is the caller's.
            self.client.close()
        self._log.info("rendezvous_left", round=self.session.round)
        return True


def _prefix_end(prefix: str) -> str:
    """The first key after every key that starts with ``prefix`` (etcd's range end)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)
