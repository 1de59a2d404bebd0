"""``RoundCoordinator``: the one node that watches every join and every node's lease.

Why: if every node watched ``nodes/`` and every ``joins/`` key, each of the N joins and N
registrations of a round would be delivered to all N nodes: O(N^2) watch events a round
(1.8 M at 256 nodes measured, and the round never completed on 2 cores). Instead one
node, the holder of ``rdzv/coordinator`` (a key on its lease), watches them and turns
what it sees into writes of the single state key that everyone watches: it closes open
rounds (``protocol.decide_coordination``: the same rule a joined node applied before)
and opens the next round, with the cause and the nodes concerned, when a member is lost
or drained, or late joiners wait. A round then costs O(N) watch events.

Election: any registered node whose view shows no coordinator creates the key
(compare create_revision == 0, on its own lease; one wins). The key vanishes with the
holder's lease (crash, freeze, partition) or its ``shutdown``; everyone sees that on
the ``rdzv/`` watch and the election runs again. The new holder takes a fresh snapshot
of ``nodes/``, ``joins/`` and ``failures/`` before it acts, so nothing that happened meanwhile is lost.
A SIGKILLed holder keeps the key until its lease expires; a node waiting in an open round
probes the holder (liveness.py) and, once it is proven gone, deletes the key (compared on
its mod_revision; the lease is left alone), so the election runs at once.

Hangs: while a round is final, the holder reads every member's beat (one range read,
at most every ``_HANG_LOOK_S``) into a ``HangWatch`` and, when ``find_hung`` names a
member, opens the next round with cause ``member_hung`` naming it (``hang_eject_s``;
rendezvous/hangs.py, docs/failure-model.md "Hung node").

Stragglers: from the same beats, a ``StragglerWatch`` flags a member persistently slower
than the median. With ``straggler_probation_s`` > 0 the holder ejects the slowest flagged
one when the job is faster without it (``stragglers.pick_ejection``), in two steps. First
it writes ``rdzv/probation/<node>`` on a fresh lease of the probation's length (fenced on
the round state), and nothing else: the straggler's agent reads that as "drain": its
workers stop at the next agreed step with everyone's, so the others re-form live without
it from that very step (a pure FSDP2 job's survivors hold its shards in their replicas of
it: nothing is rolled back), and it waits as a spare until the lease ends, then is
admitted as any joiner, then judged on a shorter trial window until its own step time has
been under the factor for one whole window (``stragglers.trial_window_s``). Only if the
straggler is still a member of the round
:func:`~elasticd.rendezvous.stragglers.drain_bound_s` later (its workers cannot stop at a
step, or they hang) is the next round opened with cause ``member_slow`` naming it: its
agent kills its workers, as for a hang.

All of this runs on one daemon thread per handler; it never blocks the agent's loop.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import structlog

from elasticd.errors import EtcdUnavailableError, LeaseLostError, TransientError
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.txn import CreateRevision, Delete, ModRevision, Put
from elasticd.etcd.watch import PrefixWatch
from elasticd.keys import JobKeys
from elasticd.records import AttributionRecord, Beat, ProbationRecord, RecordError, WaitingRecord
from elasticd.rendezvous.hangs import HangWatch, WorkerActivity
from elasticd.rendezvous.liveness import REPROBE_S, MemberProbes, PeerProber
from elasticd.rendezvous.protocol import (
    Action,
    ActionKind,
    CoordinatorMemory,
    MembershipChange,
    RendezvousView,
    decide_coordination,
)
from elasticd.rendezvous.session import NodeSession
from elasticd.rendezvous.sizes import admitted_size
from elasticd.rendezvous.stragglers import StragglerWatch, drain_bound_s, pick_ejection, probation_s
from elasticd.rendezvous.view import WatchedView

log = structlog.get_logger(__name__)

_TICK_S = 1.0  # look again at least this often (a lost wake-up, a WAIT without until)
_STALL_SECONDS = re.compile(r"\d+(\.\d+)?s\b")  # "5.5s" in a stall reason
_HANG_LOOK_S = 0.5  # read the members' beats at most this often (hang detection)


class RoundCoordinator:
    """Campaigns for ``rdzv/coordinator`` and, while holding it, coordinates rounds.

    Args:
        client: the handler's etcd client.
        keys: the job's keys.
        session: this node's lease (campaigns only while it is live).
        view: the handler's watched view; the coordinator adds the full tables to it.
        min_nodes, max_nodes, valid_sizes, last_call_timeout_s, start_settle_s: the round rule.
        finalize: writes FINALIZE (CAS of the state key); returns True if it won.
        open_next: writes OPEN_NEXT with its cause (CAS, then the opener's bookkeeping).
        defer_lost_until: when lost members must not be acted on yet (etcd trouble), or None.
        hold_previous_until: until when an open round's last call waits for members of the
            previous round (etcd trouble), or None.
        prober: probes the stragglers of a last call (liveness.py); None: never probe.
        holder_probes: probes the holder of ``rdzv/coordinator`` while we wait in an open
            round it should close (reads its record from etcd); None: never probe.
        finishing: set once this node's workers completed the job (``decide_coordination``).
        hang_eject_s: the shortest stall after which a hung member is ejected (0: never).
        stragglers: the straggler rule's memory (factor, window); None: never flag.
        on_stragglers: called with the flagged members (node -> ratio) when they change.
        straggler_probation_s: eject a flagged straggler when the shrink pays and keep it
            out this long (doubling per ejection, ``stragglers.probation_s``); 0: never.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, session: NodeSession, view: WatchedView, *,
                 min_nodes: int, max_nodes: int, last_call_timeout_s: float,
                 valid_sizes: tuple[int, ...] = (),
                 start_settle_s: float = 0.0,
                 finalize: Callable[[Action, RendezvousView, int], bool],
                 open_next: Callable[..., bool],
                 defer_lost_until: Callable[[RendezvousView], float | None],
                 hold_previous_until: Callable[[], float | None] = lambda: None,
                 prober: PeerProber | None = None,
                 holder_probes: MemberProbes | None = None,
                 finishing: threading.Event | None = None, hang_eject_s: float = 0.0,
                 stragglers: StragglerWatch | None = None,
                 on_stragglers: Callable[[dict[str, float]], None] | None = None,
                 straggler_probation_s: float = 0.0) -> None:
        self.client = client
        self.keys = keys
        self.session = session
        self.view = view
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.valid_sizes = valid_sizes
        self.last_call_timeout_s = last_call_timeout_s
        self.start_settle_s = start_settle_s
        self._finalize = finalize
        self._open_next = open_next
        self._defer_lost_until = defer_lost_until
        self._hold_previous_until = hold_previous_until
        self.prober = prober
        self.holder_probes = holder_probes
        self.finishing = finishing if finishing is not None else threading.Event()
        self._holder_probe: tuple[str, float, float] | None = None  # holder, next at, interval
        self._memory = CoordinatorMemory()
        self._watches: list[PrefixWatch] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"coordinator:{session.node_id}",
                                        daemon=True)
        self._last_reason = ""
        self._log = log.bind(job=keys.job, node=session.node_id)
        self.hang_eject_s = hang_eject_s
        self._hangs = HangWatch()
        self._hang_looked_at = 0.0
        self._last_hang_reason = ""
        self._stall_gist = ""  # the last stall reason logged, its seconds stripped
        self.stragglers = stragglers
        self.on_stragglers = on_stragglers
        self._flagged: dict[str, float] = {}
        self.straggler_probation_s = straggler_probation_s
        self._slow_ejections: dict[str, int] = {}  # node -> ejections as a straggler (ours)
        # The straggler asked to drain: (node, round, until when it may) (monotonic).
        self._draining: tuple[str, int, float] | None = None
        self._view_stale = False  # a full watch's stream broke: no decisions until it resumes

    def start(self) -> RoundCoordinator:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop coordinating (the key itself goes with our lease, revoked by the session)."""
        self._stop.set()
        self.view.touch()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self._release_watches()

    # -- the loop ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            version = self.view.version
            until: float | None = None
            try:
                until = self._step()
            except (TransientError, EtcdUnavailableError, LeaseLostError) as exc:
                self._log.warning("coordinator_step_failed", error=str(exc))
                self._stop.wait(0.5)
            except Exception:  # never let the thread die silently: log, back off, go on
                self._log.exception("coordinator_step_crashed")
                self._stop.wait(1.0)
            wait = _TICK_S if until is None else max(min(until - time.monotonic(), _TICK_S), 0.0)
            self.view.wait_change(version, wait)

    def _step(self) -> float | None:
        """One look: campaign, take up or give up the full watches, act. Returns a wake-up
        time (monotonic) when a decision depends on time."""
        view, state_rev = self.view.snapshot()
        me = self.session.node_id
        live = self.session.keeper is not None and not self.session.lease_lost.is_set()
        if view.coordinator != me:
            self._release_watches()
            if view.coordinator is None and live and not view.closed:
                self._campaign()
            elif view.coordinator is not None and live and _waiting_in_open_round(view, me):
                return self._unseat_if_dead(view.coordinator)
            self._holder_probe = None
            return None
        if not live:
            self._release_watches()
            return None
        if not self._watches:
            self._take_up_watches()
            return None  # act on the next look, from the fresh snapshot
        connected = all(w.connected.is_set() for w in self._watches)
        if not view.full:
            if connected:
                self.view.set_full(True)  # they connected after _take_up_watches gave up waiting
            return None
        if not connected:
            # A watch's stream broke (etcd restarted): until it resumes from its last revision
            # the tables miss what changed meanwhile, and a decision would act on a stale
            # view (soak seed 73010: its joins watch deaf, the coordinator closed a round's
            # last call without the three members that had joined it, and one node trained
            # alone from an older checkpoint). The tables are kept: the watch resumes them.
            if not self._view_stale:
                self._log.info("coordinator_waiting_for_watches",
                               watches=[w.name for w in self._watches if not w.connected.is_set()])
            self._view_stale = True
            return None
        if self._view_stale:
            # Resumed: the changes missed meanwhile are being replayed right now. A last call
            # counts only time the joins could be seen: it starts over.
            self._view_stale = False
            self._memory.min_reached_at.clear()
            self._log.info("coordinator_watches_resumed")
        proven = self.view.proven_dead(self.prober.dead()) if self.prober else frozenset()
        hung, hang_until = self._look_for_hangs(view)
        slow = self._straggler_to_eject(view) if hung is None else None
        if slow is not None:
            slow, drain_until = self._drain_first(slow, view, state_rev)
            if drain_until is not None:
                hang_until = drain_until if hang_until is None else min(hang_until, drain_until)
        action = decide_coordination(view, self._memory, me=me, min_nodes=self.min_nodes,
                                     max_nodes=self.max_nodes, valid_sizes=self.valid_sizes,
                                     last_call_timeout_s=self.last_call_timeout_s,
                                     now=time.monotonic(),
                                     defer_lost_until=self._defer_lost_until(view),
                                     hold_previous_until=self._hold_previous_until(),
                                     proven_dead=proven, start_settle_s=self.start_settle_s,
                                     finishing=self.finishing.is_set(), hung=hung, slow=slow)
        if action.reason != self._last_reason:
            # A round opened is a state change (info, with why); waits are chatter. A round
            # closed is logged by the write that closed it (``finalize``): the coordinator's
            # own join may close it first (the handler's path, with the same full view).
            level = "info" if action.kind is ActionKind.OPEN_NEXT else "debug"
            getattr(self._log, level)("coordinator_step", action=action.kind.value,
                                      reason=action.reason)
            self._last_reason = action.reason
        if action.kind is ActionKind.FINALIZE:
            self._finalize(action, view, state_rev)
        elif action.kind is ActionKind.OPEN_NEXT:
            if action.cause == MembershipChange.MEMBER_SLOW.value:
                self._eject_straggler(action, view, state_rev)
            elif (self._open_next(action, view, state_rev)
                    and action.cause == MembershipChange.MEMBER_HUNG.value):
                self._log.warning("member_ejected", ejected=list(action.changed), cause="hung",
                                  round=action.round, reason=action.reason)
        elif action.kind is ActionKind.ATTRIBUTE:
            verdict = AttributionRecord(action.round, list(action.members))
            self.client.put(self.keys.rdzv_attribution, verdict.to_json())
        elif action.kind is ActionKind.ANNOUNCE:
            record = WaitingRecord(action.round, list(action.members))
            self.client.put(self.keys.rdzv_waiting, record.to_json())
        elif action.kind is ActionKind.WAIT:
            until = action.until
            if action.probe and self.prober is not None:
                # A straggler proven dead wakes us (the prober touches the view); one that
                # answered is probed again when due, until the last call ends.
                due = self.prober.request(self.view.probe_targets(action.probe))
                if due is not None:
                    until = due if until is None else min(until, due)
            return until
        return hang_until

    def _look_for_hangs(self, view: RendezvousView) -> tuple[tuple[str, str] | None, float | None]:
        """Read the members' beats (throttled) and ask ``find_hung``; returns (node,
        reason) to eject or None, and when to look again (None: no hurry)."""
        state = view.state
        watching = self.hang_eject_s > 0 or self.stragglers is not None
        if not watching or state is None or state.phase != "final" or len(state.members) < 2:
            return None, None
        now = time.monotonic()
        if now - self._hang_looked_at >= _HANG_LOOK_S or self._hangs.round != state.round:
            # A new round is read at once: until then the watch holds the old round's facts.
            self._hang_looked_at = now
            beats = self._read_beats()
            self._hangs.observe(state.round, state.members, {n: b[:4] for n, b in beats.items()}, now)
            self._look_for_stragglers(state.round, state.members, beats, now)
        if self.hang_eject_s <= 0:
            return None, None
        verdict = self._hangs.verdict(state.round, state.members, now=now, floor_s=self.hang_eject_s,
                                      min_nodes=self.min_nodes,
                                      blind_until=self.client.last_trouble_at)
        if verdict.reason != self._last_hang_reason:
            self._log.debug("hang_looked", node=verdict.node, reason=verdict.reason)
            self._last_hang_reason = verdict.reason
        # A stall the verdict cannot pin on one node is what an operator asks about: say it
        # once per distinct reason (its seconds aside) and once when progress resumes.
        gist = _STALL_SECONDS.sub("", verdict.reason) if verdict.stalled_s > 0 else ""
        if gist != self._stall_gist:
            if gist and verdict.node is None:
                self._log.info("job_stalled", round=state.round, reason=verdict.reason,
                               armed=self._hangs.armed(state.round, state.members))
            elif not gist and self._stall_gist:
                self._log.info("job_progressing", round=state.round)
            self._stall_gist = gist
        if not self._hangs.armed(state.round, state.members):
            return None, None
        again = self._hang_looked_at + _HANG_LOOK_S
        return ((verdict.node, verdict.reason) if verdict.node else None), again

    def _look_for_stragglers(self, round_: int, members: list[str],
                             beats: dict[str, tuple[int, int, WorkerActivity, float, float]],
                             now: float) -> None:
        """Feed the members' own step times (step_s x busy share) to the straggler rule;
        report the flagged set when it changes (logged, ``on_stragglers``)."""
        if self.stragglers is None:
            return
        own = {n: b[3] * b[4] for n, b in beats.items() if b[0] == round_ and b[3] > 0 and b[4] > 0}
        verdict = self.stragglers.observe(round_, members, own, now)
        for node in sorted(verdict.trials_passed):
            self._log.info("straggler_trial_passed", node=node, round=round_,
                           window_s=self.stragglers.window_s)
        flagged = dict(verdict.flagged)
        if set(flagged) != set(self._flagged):
            if flagged:
                self._log.warning("stragglers_flagged", nodes=flagged, reason=verdict.reason)
            else:
                self._log.info("stragglers_cleared", reason=verdict.reason)
            self._flagged = flagged
            if self.on_stragglers is not None:
                self.on_stragglers(flagged)

    def _straggler_to_eject(self, view: RendezvousView) -> tuple[str, str] | None:
        """The flagged straggler the policy ejects now (``pick_ejection``), or None."""
        state = view.state
        if (self.straggler_probation_s <= 0 or self.stragglers is None or not self._flagged
                or state is None or state.phase != "final"):
            return None
        own = {n: s for n, s in self.stragglers.latest().items() if n in state.members}
        if set(own) != set(state.members):
            return None  # a member's own step time is unknown: no comparison

        def size_ok(n: int) -> bool:
            return admitted_size(n, self.valid_sizes, min_nodes=self.min_nodes,
                                 max_nodes=self.max_nodes) == n

        return pick_ejection({n: r for n, r in self._flagged.items() if n in own}, own,
                             min_nodes=self.min_nodes, size_ok=size_ok)

    def _drain_first(self, slow: tuple[str, str], view: RendezvousView,
                     state_rev: int) -> tuple[tuple[str, str] | None, float | None]:
        """The straggler to eject now by opening the next round, or None while it drains;
        and when to look again.

        The first sight puts it on probation, which its agent reads as "drain" (no round
        is opened). Once it has been on probation for :func:`drain_bound_s` while still a
        member of the round, it is ejected the hard way (``member_slow``).
        """
        node, reason = slow
        assert view.state is not None
        r, now = view.state.round, time.monotonic()
        step_s = max(self.stragglers.latest().values(), default=0.0) if self.stragglers else 0.0
        bound = drain_bound_s(step_s)
        if node not in view.probation:
            if not self._put_on_probation(node, r, state_rev):
                return None, None  # the round moved meanwhile: look again at the new one
            self._draining = (node, r, now + bound)
            self._log.warning("straggler_draining", node=node, round=r, reason=reason,
                              bound_s=round(bound, 1))
            return None, now + bound
        if self._draining is None or self._draining[:2] != (node, r):
            # On probation already (an earlier coordinator asked): the bound runs from now.
            self._draining = (node, r, now + bound)
        until = self._draining[2]
        if now < until:
            return None, until
        return (node, f"{reason}; it did not stop at a step within {bound:.0f}s of being "
                      "asked to drain"), None

    def _put_on_probation(self, node: str, round_: int, state_rev: int) -> bool:
        """Write ``rdzv/probation/<node>`` on a fresh lease, fenced on the round state
        (still round ``round_``, final); True if written."""
        count = self._slow_ejections.get(node, 0) + 1
        length = probation_s(self.straggler_probation_s, count)
        record = ProbationRecord(node, ratio=self._flagged.get(node, 0.0), probation_s=length,
                                 ejections=count, round=round_, since=time.time())
        lease = self.client.grant_lease(max(int(round(length)), 1))
        put = Put(self.keys.probation(node), record.to_json(), lease=lease)
        if self.client.txn([ModRevision(self.keys.rdzv_state, state_rev)], [put]):
            self._slow_ejections[node] = count
            if self.stragglers is not None:
                self.stragglers.put_on_trial(node)  # judged on the trial window once back
            # ``round``: the first round without it, as for an ejection by a new round.
            self._log.warning("member_ejected", ejected=[node], cause="straggler", round=round_ + 1,
                              probation_s=length, how="drained at the next agreed step")
            return True
        self.client.revoke_lease(lease)
        return False

    def _eject_straggler(self, action: Action, view: RendezvousView, state_rev: int) -> None:
        """Open the next round without the straggler (on probation already: it did not
        drain within the bound)."""
        if self._open_next(action, view, state_rev):
            self._draining = None
            self._log.warning("member_ejected", ejected=list(action.changed), cause="straggler",
                              round=action.round, reason=action.reason, how="workers killed")

    def _read_beats(self) -> dict[str, tuple[int, int, WorkerActivity, float, float]]:
        """Every beat under ``beats/``: node -> (round, step, activity, step_s,
        busy_share); a beat that does not decode is left out (validated, never trusted)."""
        out: dict[str, tuple[int, int, WorkerActivity, float, float]] = {}
        kvs, _ = self.client.get_prefix(self.keys.beats_prefix)
        for kv in kvs:
            try:
                beat = Beat.from_json(kv.value)
                activity = WorkerActivity(beat.activity) if beat.activity else WorkerActivity.UNKNOWN
            except (RecordError, ValueError):
                continue
            out[kv.key.rsplit("/", 1)[-1]] = (beat.round, beat.step, activity, beat.step_s,
                                              min(max(beat.busy_share, 0.0), 1.0))
        return out

    def _unseat_if_dead(self, holder: str) -> float | None:
        """Delete ``rdzv/coordinator`` if a liveness probe proved its holder gone.

        Why: a SIGKILLed coordinator holds the key until its lease expires, and until
        then nobody closes the round the survivors opened at once on their failed
        collectives. Only the key goes (compared on its mod_revision, so a new holder's
        key is never touched); the dead node's lease is left to expire. If the holder was
        in fact alive (a firewall that rejects: see ``rendezvous.liveness_probe``), the
        cost is one election. Returns when to look again (the next probe), or None.
        """
        if self.holder_probes is None:
            return None
        now = time.monotonic()
        if holder not in self.holder_probes.known_dead([holder]):
            # Backed off (0.25 s, doubling to 2 s): every joined node of a large job waits
            # here while a round fills up, and each probe costs an etcd read.
            memo = self._holder_probe
            if memo is not None and memo[0] == holder and now < memo[1]:
                return memo[1]
            interval = REPROBE_S if memo is None or memo[0] != holder else min(memo[2] * 2, 2.0)
            self._holder_probe = (holder, now + interval, interval)
            self.holder_probes.proven_dead([holder])  # starts a probe; its answer wakes us
            return now + interval
        kv = self.view.rdzv_get(self.keys.rdzv_coordinator)
        if kv is None or kv.value.decode(errors="replace") != holder:
            return None
        if self.client.txn([ModRevision(kv.key, kv.mod_revision)], [Delete(kv.key)]):
            self._log.info("coordinator_unseated", holder=holder,
                           reason="its agent is gone (liveness probe refused)")
        return None

    def _campaign(self) -> None:
        key = self.keys.rdzv_coordinator
        if self.client.txn([CreateRevision(key, 0)],
                           [Put(key, self.session.node_id, lease=self.session.lease_id)]):
            self._log.info("coordinator_elected")

    def _take_up_watches(self) -> None:
        k = self.keys
        self._memory = CoordinatorMemory()
        self._watches = [
            self.client.watch_prefix(k.nodes_prefix, self.view.on_nodes, self.view.on_nodes_resync,
                                     name="nodes"),
            self.client.watch_prefix(k.joins_root, self.view.on_joins, self.view.on_joins_resync,
                                     name="joins"),
            self.client.watch_prefix(k.failures_root, self.view.on_failures,
                                     self.view.on_failures_resync, name="failures"),
        ]
        deadline = time.monotonic() + 10.0
        for w in self._watches:
            w.connected.wait(max(deadline - time.monotonic(), 0.1))
        self.view.set_full(all(w.connected.is_set() for w in self._watches))

    def _release_watches(self) -> None:
        if not self._watches:
            return
        watches, self._watches = self._watches, []
        self.view.set_full(False)
        for w in watches:
            w.stop(wait=False)
        self._log.info("coordinator_stepped_down")


def _waiting_in_open_round(view: RendezvousView, me: str) -> bool:
    """We joined the open round and wait for the coordinator to close it."""
    state = view.state
    return state is not None and state.phase == "open" and me in view.joins.get(state.round, ())
