"""Restart policy as pure functions: what the agent does after each look at its workers.

The agent loop (``elastic_agent.py``) gathers facts — worker group state, drain flags,
membership, hang, failure attribution, budget — and ``decide`` returns one ``Decision``
with a human-readable reason. Policy in one line each:

- Membership changes never spend the restart budget.
- A worker failure spends one unit, after an exponential backoff; only the node whose
  failure came first (the root cause) spends it, its peers' failures are membership.
- A hang (no rank advanced for ``hang_timeout_s`` after the first step) is a failure.
- Ejected by the coordinator (our workers hung the job: ``rendezvous.hangs``): kill them now
  and rejoin cold, a membership change (no budget spent); the others re-form without us.
- A drain stops at the next step boundary; a second signal or the grace period running
  out stops hard.
- A scale-up (only new nodes wait to join) is a *resize*: workers that call
  ``should_stop`` are asked to stop at the next step boundary and save, then the job
  re-forms with the newcomers; no step is lost. Workers that never call ``should_stop``
  are restarted at once, as is everything else that changes membership. A resize waits
  for the workers (even if a peer re-forms first) until ``resize_grace_s``, then restarts
  them hard.
- Exit code 2 on the first start (argument parsing) is not retried: it will not go away.
- Nor is a failure that repeats: when no attempt on this node ever got past start-up (no
  step reported, and none ran ``STARTUP_S``) and this attempt failed with the same
  exception line as every one before it (a script that raises at import), the second
  such failure gives up instead of spending the rest of the budget the same way.
  Nor is exit code 78 (EX_CONFIG: a worker raised ``ConfigError``) at any time: the agent
  gives up with 78.
- A stop signal when the workers never called ``should_stop`` (a plain script, or one
  not yet at its first step) stops them at once (``plain_stop_s`` for their own SIGTERM
  handler) and leaves: they would not honour a drain, so waiting ``drain_grace_s`` only
  delays the peers' re-form.
- Workers whose script returned with 0 (every local rank wrote ``done-<rank>``) have
  finished, whatever torch's teardown does next: an abort after that is success, and a
  process still there ``done_exit_s`` later is stopped and counted done.

Live re-formation (``Facts.live``, when every local worker registered for it) comes after
all of that, in the same function: a stop, a drain, a fence, a hang or a completion is
never overridden by it; a membership change (or a worker's failed collective) is handled
in place instead of by a restart:

- a join parks the workers first (they leave their group at the next agreed step), even
  when the restart policy would restart: an order alone never reaches a worker whose
  collectives all succeed;
- a lost or drained peer, or workers that parked, re-form live: the next round runs now
  and the workers are ordered into it;
- the re-formation ends when every worker confirmed it, and falls back to a restart
  (a membership change: no budget spent) past its bound, or when a member it waits for is
  lost again;
- workers that fail while it is under way are started again cold *in the round being
  re-formed* (``RESTART_IN_ROUND``), as a joiner's are, and receive the survivors' state:
  a newer round would make the peers re-forming for this one fall back to the checkpoint
  (to step 0 before the first one). The budget is spent as the restart policy says (a
  worker failure when no node left; failed in the superseded round before taking the
  order: a membership change); a verdict that gives up (``FAIL``) abandons it;
- workers that end otherwise mid-way abandon it: the restart policy's verdict stands.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from elasticd.rendezvous.protocol import Attribution, MembershipChange

EX_CONFIG = 78  # a worker's ConfigError (sysexits.h EX_CONFIG): deterministic, never retried
# An attempt that ran this long got past start-up even without reporting a step (a plain
# script reports none): its failure may be a transient one, worth the restart budget.
STARTUP_S = 60.0
# A join waits for our starting workers to register at most this many times as long as the
# slowest registration seen on this node, plus the slack (start-up varies with the load).
REGISTRATION_FACTOR = 2.0
REGISTRATION_SLACK_S = 10.0


# Why a live re-formation fell back when its workers were still at it when the bound passed
# (the agent asks them for their stacks first: where they hung is in the log).
REFORM_TIMED_OUT = "workers did not re-form within the bound"


class Verdict(enum.Enum):
    CONTINUE = "continue"  # keep monitoring
    START_DRAIN = "start_drain"  # ask workers to stop at the next step
    START_RESIZE = "start_resize"  # nodes join: ask workers to stop at the next step, stay
    RESTART_MEMBERSHIP = "restart_membership"  # re-rendezvous, budget untouched
    RESTART_FAILURE = "restart_failure"  # back off, spend budget, re-rendezvous
    ATTRIBUTE = "attribute"  # a failure: wait for peers' reports before deciding
    FENCE = "fence"  # our lease is gone: kill workers now, rejoin as a new member
    EJECTED = "ejected"  # the coordinator ejected us (hung): kill workers now, rejoin cold
    # The coordinator put us on probation (a straggler): the workers stop at the next agreed
    # step with everyone's (nothing rolled back), then we rejoin as a spare.
    START_EJECT_DRAIN = "start_eject_drain"
    LEAVE = "leave"  # drained: leave the rendezvous and exit 0
    HARD_STOP = "hard_stop"  # drain grace over / second signal: kill workers, leave
    STOP_NOW = "stop_now"  # stop requested, workers cannot drain: SIGTERM them (briefly), leave
    FINISH = "finish"  # the job completed
    FAIL = "fail"  # budget exhausted or non-retryable: exit non-zero
    # Live re-formation (Facts.live): the workers stay, the group re-forms around them.
    PARK = "park"  # nodes join: the workers leave their group at the next agreed step
    REFORM_LIVE = "reform_live"  # run the next round now and order the workers into it
    LIVE_WAIT = "live_wait"  # a park or a re-formation is under way: nothing to do
    LIVE_DONE = "live_done"  # every worker re-formed: the node trains in the new round
    LIVE_FALLBACK = "live_fallback"  # in place failed: restart the workers (a membership change)
    # Our workers failed while the job re-forms live in a round that holds us: start them
    # cold in that round (no rendezvous), as a joiner's; Decision.spends_budget says how.
    RESTART_IN_ROUND = "restart_in_round"


class GroupState(enum.Enum):
    """The worker group's state, as torch's ``WorkerState`` names it (``GroupState[name]``)."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


_FAILED = (GroupState.FAILED, GroupState.UNHEALTHY)
# A peer's drain or a departure our workers may already be saving for (see _membership_changed).
_AFTER_AGREED_STOP = (MembershipChange.NEWER_ROUND, MembershipChange.MEMBER_LOST,
                      MembershipChange.MEMBER_LEFT, MembershipChange.MEMBER_HUNG,
                      MembershipChange.MEMBER_SLOW)


class LivePhase(enum.Enum):
    """Where this node's live re-formation stands (the agent's, not the workers')."""

    IDLE = "idle"  # none under way
    PARKING = "parking"  # the workers were asked to leave their group at the next agreed step
    REFORMING = "reforming"  # an order is out, not every worker confirmed it yet


@dataclass(frozen=True)
class LiveFacts:
    """The live re-formation part of a tick's facts (``Facts.live``).

    Present only when live re-formation is on and every local worker registered for it;
    the workers' reports are read from the control channel.
    """

    phase: LivePhase = LivePhase.IDLE
    parked_all: bool = False  # every local worker left its group and waits for an order
    parked_any_failure: bool = False  # a local worker's collective failed (a peer died)
    reformed_all: bool = False  # REFORMING: every worker confirmed the order's round
    # REFORMING: every worker has left its old group (parked) or re-formed: none of them
    # still runs in the superseded round.
    left_old_all: bool = False
    deadline_passed: bool = False  # the park's or the re-formation's bound passed
    # REFORMING: the order's round holds every node of the round before it (no node was
    # lost or left: a collective that failed then failed because of a worker of ours).
    nobody_left: bool = False


@dataclass(frozen=True)
class Facts:
    """Everything ``decide`` looks at, gathered by the agent loop in one tick."""

    group_state: GroupState
    drain_signals: int = 0  # SIGTERM/SIGINT received (and notices)
    draining: bool = False  # drain already requested from the workers
    drain_deadline_passed: bool = False
    # Workers left stopped-<rank> markers: when SUCCEEDED they stopped for a drain; when
    # HEALTHY (looked at only while nodes wait) they are stopping, saving a checkpoint.
    stopped_for_drain: bool = False
    lease_lost: bool = False
    # Non-empty when the coordinator ejected this node (its workers hang the job, or it is
    # a straggler the job is faster without): why.
    ejected: str = ""
    # Non-empty when the coordinator put this node on probation as a straggler while it is
    # a member of the round it trains in: it asks us to drain (stragglers.drain_bound_s).
    asked_to_drain: str = ""
    ejecting: bool = False  # our workers were asked to stop at the next step for that
    eject_deadline_passed: bool = False  # ... and did not within our own bound
    nodes_waiting: int = 0
    # Kind of membership change while nodes_waiting > 0 (NONE otherwise).
    membership: MembershipChange = MembershipChange.NONE
    membership_reason: str = ""  # human-readable, from the rendezvous handler
    resize_enabled: bool = True  # resize_grace_s > 0: admit joiners through a drain
    workers_drainable: bool = False  # a worker of this group called should_stop
    resizing: bool = False  # we asked our workers to stop so that joiners can be admitted
    resize_deadline_passed: bool = False
    hang: bool = False
    attribution: Attribution | None = None  # of a local failure; None when there is none
    attribution_window_passed: bool = False
    remaining_restarts: int = 0
    exit_codes: tuple[int, ...] = ()
    first_start: bool = True  # this worker group is the first one started on this node
    any_progress: bool = False  # some rank reported a step in this worker group
    # Every local worker's script returned with 0 (done-<rank> markers): the work is done.
    workers_done: bool = False
    done_exit_passed: bool = False  # ... and some are still running done_exit_s later
    # The root failure's exception line this tick ("ModuleNotFoundError: ..."), or how it
    # ended ("exit code 1"); "" when there is no failure.
    failure_line: str = ""
    # The lines of this node's earlier failed attempts, while none got past start-up.
    startup_failures: tuple[str, ...] = ()
    past_startup: bool = False  # some attempt reported a step or ran STARTUP_S
    # Live re-formation: None when it is off or some local worker did not register for it.
    live: LiveFacts | None = None
    # Live re-formation is on, this worker group started less than live_reform_timeout_s
    # ago, has reported no step, and some local worker has not registered for it yet (it is
    # still importing; a script without LiveState never registers, and stops counting as
    # starting at its first step).
    live_starting: bool = False
    # Seconds since this worker group started, and the longest a worker group of this node
    # took until every local worker registered for live re-formation (None: none ever did).
    group_age_s: float = 0.0
    registered_after_s: float | None = None
    # This group's workers run a script that does not use the worker API (past their
    # imports without writing the API's marker: reform.PlainScriptWatch): they never register.
    workers_plain: bool = False


def repeats_at_startup(f: Facts) -> bool:
    """True when no attempt got past start-up and every one failed with ``f.failure_line``."""
    return (not f.past_startup and bool(f.failure_line) and bool(f.startup_failures)
            and all(line == f.failure_line for line in f.startup_failures))


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    exit_code: int = 1  # for FAIL: the agent's exit status
    # Non-empty when a park or re-formation under way ends with this decision (the
    # workers ended mid-way): why. The agent forgets it, then carries out ``verdict``.
    live_abandoned: str = ""
    # RESTART_IN_ROUND: a worker failure (one unit of the budget, after the backoff), not a
    # membership change.
    spends_budget: bool = False


# The restart policy's verdicts that live re-formation may replace: the others (stop,
# drain, fence, hang, completion) always act first.
_LIVE_MAY_ACT = (Verdict.CONTINUE, Verdict.RESTART_MEMBERSHIP, Verdict.START_RESIZE,
                 Verdict.ATTRIBUTE)
_MEMBERSHIP_VERDICTS = (Verdict.RESTART_MEMBERSHIP, Verdict.START_RESIZE)
# The restart policy's verdicts on workers that failed during a live re-formation that
# leave them to it (RESTART_IN_ROUND, or its FAIL); the others act first.
_MAY_RESTART_IN_ROUND = (Verdict.RESTART_FAILURE, Verdict.RESTART_MEMBERSHIP, Verdict.ATTRIBUTE,
                         Verdict.FAIL)
# A second change during a re-formation that the new group cannot survive.
_GROUP_CANNOT_FORM = (MembershipChange.MEMBER_LOST, MembershipChange.NEWER_ROUND,
                      MembershipChange.MEMBER_HUNG, MembershipChange.MEMBER_SLOW)


def decide(f: Facts) -> Decision:
    """Map one tick's facts to the next action. Pure; precedence is top to bottom: the
    restart policy first, then live re-formation (``f.live``) where it may replace it."""
    if f.ejecting and not f.lease_lost and not f.drain_signals:
        return _decide_ejecting(f)
    restart = _decide_restart(f)
    if f.live is None and f.live_starting and may_still_register(f) and not f.draining and \
            restart.verdict in _MEMBERSHIP_VERDICTS and f.membership is MembershipChange.JOIN:
        # Why: a node admitted in the round being re-formed (its workers still starting)
        # used to restart for the next joiner and open a round itself; the members,
        # re-forming for this round, saw it as a newer round and fell back to the
        # checkpoint (spot replay: 116 steps retrained when four nodes came back within
        # 5 s). A join is never urgent: once our workers register, they park with the
        # members for it like everyone else's.
        return Decision(Verdict.CONTINUE, "nodes join while our workers start: they take "
                        "part once they registered for live re-formation")
    if f.live is None or f.draining:
        return restart
    return _decide_live(f, f.live, restart)


def may_still_register(f: Facts) -> bool:
    """Whether our starting workers (``f.live_starting``) may still register for live
    re-formation, by what this node has seen of its own workers. Pure.

    - Some worker group of this node registered: for ``REGISTRATION_FACTOR`` times its
      slowest registration plus ``REGISTRATION_SLACK_S`` after the start.
    - None ever did: only in the node's first worker group (a node just admitted, whose
      workers are still importing: the spot replay's case), and not once its workers are
      known to run a plain script (``f.workers_plain``: past their imports without the
      worker API's marker). A later group follows one that ran and ended without
      registering: the script does not use the worker API (a plain script never registers,
      and a join must not wait ``live_reform_timeout_s`` for it: issue 52, a restarted node
      of a plain script waited 30 s after every recovery, and a plain script's first group
      deferred every join of its first 30 s).
    """
    if f.registered_after_s is not None:
        return f.group_age_s < REGISTRATION_FACTOR * f.registered_after_s + REGISTRATION_SLACK_S
    return f.first_start and not f.workers_plain


def _decide_ejecting(f: Facts) -> Decision:
    """Our workers were asked to stop at the next agreed step: we were ejected as a
    straggler (a lost lease and a stop signal go to the restart policy first)."""
    if f.group_state is not GroupState.HEALTHY:
        return Decision(Verdict.EJECTED, "our workers stopped for our ejection as a straggler "
                        f"({f.group_state.value}): rejoining as a spare on probation")
    if f.ejected:
        return Decision(Verdict.EJECTED, f"ejected by the job: {f.ejected}; killing our workers, "
                        "rejoining cold")
    if f.eject_deadline_passed:
        return Decision(Verdict.EJECTED, "our workers did not stop at a step for our ejection "
                        "within the bound: killing them, rejoining cold")
    return Decision(Verdict.CONTINUE, "ejected as a straggler: our workers stop at the next "
                    "agreed step")


def _decide_live(f: Facts, live: LiveFacts, restart: Decision) -> Decision:
    """Live re-formation's part of the precedence: ``restart`` is the restart policy's verdict."""
    reforming, parking = live.phase is LivePhase.REFORMING, live.phase is LivePhase.PARKING
    if f.group_state is not GroupState.HEALTHY:
        if reforming and f.group_state in _FAILED:
            return _failed_while_reforming(f, live, restart)
        if reforming or parking:
            return dataclasses.replace(restart, live_abandoned=(
                f"workers ended during the re-formation ({f.group_state.value}): "
                "the restart policy decides"))
        return restart
    if restart.verdict not in _LIVE_MAY_ACT:
        return restart
    if reforming:
        if live.reformed_all:
            return Decision(Verdict.LIVE_DONE, "every worker re-formed")
        if restart.verdict is Verdict.RESTART_MEMBERSHIP and f.membership in _GROUP_CANNOT_FORM:
            # A member the workers wait for is gone (or the job moved on), so the group
            # cannot form and waiting for the bound would only delay the restart. (A join
            # waits: it parks after this one.)
            return Decision(Verdict.LIVE_FALLBACK, "membership changed again during the "
                            f"re-formation ({f.membership.value})")
        if live.deadline_passed:
            return Decision(Verdict.LIVE_FALLBACK, REFORM_TIMED_OUT)
        return Decision(Verdict.LIVE_WAIT, "waiting for workers to re-form")
    if live.parked_any_failure:
        return Decision(Verdict.REFORM_LIVE, "a collective failed (a peer is gone): "
                        "opening the next round now")
    if live.parked_all:
        return Decision(Verdict.REFORM_LIVE, "workers left their group at the agreed step")
    if restart.verdict in _MEMBERSHIP_VERDICTS:
        if f.membership is not MembershipChange.JOIN:
            kind = f.membership.value if f.membership is not MembershipChange.NONE else "peer"
            return Decision(Verdict.REFORM_LIVE, f"membership changed ({kind}): re-forming in place")
        # A join parks first, even when the restart policy would restart (a group that has
        # not trained yet): a worker leaves its group only at an agreed step or on a failed
        # collective, so an order alone never reaches one whose collectives all succeed
        # (a node alone at world size 1 trained on, and was restarted after the bound).
        if parking and live.deadline_passed:
            return Decision(Verdict.LIVE_FALLBACK, "workers did not reach an agreed step "
                            "within the bound")
        if parking:
            return Decision(Verdict.LIVE_WAIT, "waiting for workers to park")
        return Decision(Verdict.PARK, "nodes join: workers leave the group at the next step")
    if parking:
        return Decision(Verdict.LIVE_WAIT, "waiting for workers to park")
    return restart


def _failed_while_reforming(f: Facts, live: LiveFacts, restart: Decision) -> Decision:
    """Local workers failed while the job re-forms live in a round that holds this node
    (``restart``: the restart policy's verdict on that failure).

    Why: restarting through the next rendezvous opened a newer round; the peers, still
    re-forming for this one, saw it and fell back to the checkpoint, so their workers'
    in-memory steps were lost (before the first checkpoint: back to step 0, a worker crash
    that raced the re-formation it caused on a loaded machine). Started in this round, our
    workers are cold members of the group the peers form, and the survivors send them the
    state, as to a joiner's.
    """
    where = "starting them cold in the round being re-formed"
    if restart.verdict not in _MAY_RESTART_IN_ROUND or EX_CONFIG in f.exit_codes:
        # A fence, an ejection, a stop, completed workers or a configuration error act
        # first, as everywhere else.
        return dataclasses.replace(restart, live_abandoned=(
            f"workers failed during the re-formation: {restart.reason}"))
    if not live.left_old_all and not live.nobody_left:
        # They failed in the round the order superseded (a zombie's commit is refused
        # there): a consequence of the membership change, which spends no budget.
        return Decision(Verdict.RESTART_IN_ROUND, "workers failed in the superseded round "
                        f"before taking the order: {where}")
    # A worker failure as the restart policy judges it. With every node still in the job
    # (nobody_left), the collective that started this re-formation failed because one of
    # our own workers died (its local peers saw the broken connection before torch's
    # monitor saw the exit): the budget is spent, so a worker that crashes at the same step
    # every time ends the job instead of looping.
    if restart.verdict is Verdict.ATTRIBUTE:
        return restart  # the re-formation stays under way while the window runs
    if restart.verdict is Verdict.FAIL:  # the budget is spent, or a failure repeats
        return dataclasses.replace(restart, live_abandoned=(
            f"workers failed during the re-formation: {restart.reason}"))
    why = ("a local worker failed and no node left the job" if live.nobody_left
           else "workers failed during the re-formation")
    return Decision(Verdict.RESTART_IN_ROUND, f"{why} ({restart.reason}): {where}",
                    spends_budget=restart.verdict is Verdict.RESTART_FAILURE)


def _decide_restart(f: Facts) -> Decision:
    """The restart policy (no live re-formation). Precedence is top to bottom."""
    if f.lease_lost:
        return Decision(Verdict.FENCE, "lease lost: the job moved on without us; rejoining")
    if f.ejected and not f.drain_signals and f.group_state in (GroupState.HEALTHY, *_FAILED):
        # Hung workers reach no step boundary. A stop signal goes to the drain below
        # instead (it leaves; the others already re-form without us).
        return Decision(Verdict.EJECTED, f"ejected by the job: {f.ejected}; killing our "
                        "workers, rejoining cold")
    if f.asked_to_drain and not f.drain_signals and f.group_state is GroupState.HEALTHY \
            and (f.live is None or f.live.phase is LivePhase.IDLE):
        # Drained, not killed: everyone stops at the same step, so a pure FSDP2 job's
        # survivors hold our shards in their replicas of that very step (0 rolled back).
        if f.workers_drainable:
            return Decision(Verdict.START_EJECT_DRAIN, f"ejected as a straggler ({f.asked_to_drain}): "
                            "our workers stop at the next agreed step, then we wait as a spare")
        return Decision(Verdict.EJECTED, f"ejected as a straggler ({f.asked_to_drain}); our "
                        "workers never called should_stop (they cannot stop at a step): killing "
                        "them, rejoining cold")
    if f.draining and (f.drain_signals >= 2 or f.drain_deadline_passed):
        why = "second stop signal" if f.drain_signals >= 2 else "drain grace period over"
        return Decision(Verdict.HARD_STOP, f"{why}: stopping workers hard")
    if f.drain_signals and not f.draining:
        if f.group_state is GroupState.HEALTHY and not f.workers_drainable and not f.workers_done:
            return Decision(Verdict.STOP_NOW, "stop requested and the workers never called "
                            "should_stop (they cannot drain): stopping them now, leaving")
        return Decision(Verdict.START_DRAIN, "stop requested: workers stop at the next step")

    state = f.group_state
    if f.workers_done and state in _FAILED:
        codes = ",".join(str(c) for c in f.exit_codes) or "?"
        return _succeeded(f, f"all workers completed their script (exit {codes} in torch's "
                          "teardown after that ignored)")
    if f.workers_done and state is GroupState.HEALTHY and f.done_exit_passed:
        return _succeeded(f, "all workers completed their script but did not exit: stopping them")
    if state is GroupState.SUCCEEDED:
        return _succeeded(f, "all workers succeeded")
    if state in _FAILED:
        if f.draining:
            return Decision(Verdict.LEAVE, "workers exited with errors during our drain: leaving")
        if EX_CONFIG in f.exit_codes:
            return Decision(Verdict.FAIL, "a worker exited with 78 (configuration error): "
                            "not retrying, it would fail the same way", EX_CONFIG)
        if f.first_start and not f.any_progress and 2 in f.exit_codes:
            return Decision(Verdict.FAIL, "exit code 2 on the first start (bad arguments?): not retrying")
        if f.attribution in (Attribution.MEMBERSHIP, Attribution.VICTIM):
            return Decision(Verdict.RESTART_MEMBERSHIP,
                            f"worker failure caused by a peer ({f.attribution.value})")
        if f.attribution is Attribution.ROOT or f.attribution_window_passed:
            if repeats_at_startup(f):
                return Decision(Verdict.FAIL, f"all {len(f.startup_failures) + 1} attempts "
                                "failed the same way before their first step, not retrying: "
                                f"{f.failure_line}")
            if f.remaining_restarts > 0:
                return Decision(Verdict.RESTART_FAILURE, "worker failure: restarting")
            return Decision(Verdict.FAIL, "worker failure and the restart budget is spent")
        return Decision(Verdict.ATTRIBUTE, "worker failure: waiting to see whether a peer caused it")
    if state is GroupState.HEALTHY:
        if f.hang:
            if f.remaining_restarts > 0:
                return Decision(Verdict.RESTART_FAILURE, "workers hung: restarting")
            return Decision(Verdict.FAIL, "workers hung and the restart budget is spent")
        if f.draining:
            return Decision(Verdict.CONTINUE, "draining: waiting for workers to stop")
        if f.resizing:
            return _while_resizing(f)
        if f.nodes_waiting > 0:
            return _membership_changed(f)
        return Decision(Verdict.CONTINUE, "healthy")
    return Decision(Verdict.CONTINUE, f"worker group {state.value}")


def _succeeded(f: Facts, why: str) -> Decision:
    """The workers are done (exit 0, or done markers): finished, drained, or re-forming."""
    if f.draining:
        return Decision(Verdict.LEAVE, "workers stopped for our drain: leaving the job")
    if f.stopped_for_drain and f.resizing:
        return Decision(Verdict.RESTART_MEMBERSHIP, "workers stopped for the resize: re-forming")
    if f.stopped_for_drain:
        return Decision(Verdict.RESTART_MEMBERSHIP, "workers stopped for a peer's drain")
    return Decision(Verdict.FINISH, why)


def _membership_changed(f: Facts) -> Decision:
    """HEALTHY workers, nodes waiting, no resize yet: resize through a drain, or restart now."""
    why = f.membership_reason or "membership changed"
    if f.resize_enabled and f.stopped_for_drain and f.membership in _AFTER_AGREED_STOP:
        # Our workers already agreed on a stop step (a peer's drain or a resize) and are
        # saving. The peer that drained and left (member_left), or one that re-formed
        # first, must not cut that save short: killing them now could
        # lose the drain's checkpoint. Wait for them (bounded by resize_grace_s).
        return Decision(Verdict.START_RESIZE, f"{why}: our workers are stopping at the agreed "
                        "step: waiting for them")
    if f.resize_enabled and f.workers_drainable and f.membership is MembershipChange.JOIN:
        return Decision(Verdict.START_RESIZE, f"{why}: workers stop at the next step, then "
                        "the job re-forms with them")
    if why == "membership changed":
        return Decision(Verdict.RESTART_MEMBERSHIP, why)
    return Decision(Verdict.RESTART_MEMBERSHIP, f"membership changed: {why}")


def _while_resizing(f: Facts) -> Decision:
    """HEALTHY workers asked to stop for a resize: wait for them, unless a peer is lost."""
    if f.resize_deadline_passed:
        return Decision(Verdict.RESTART_MEMBERSHIP, "resize grace period over: restarting workers hard")
    if f.nodes_waiting > 0 and f.membership is MembershipChange.MEMBER_LOST and not f.stopped_for_drain:
        why = f.membership_reason or "a member was lost"
        return Decision(Verdict.RESTART_MEMBERSHIP, f"{why} during the resize: restarting workers")
    # A newer round opened by a peer (its workers finished first) or the joiner vanishing
    # changes nothing: our workers agreed on the same stop step and are saving.
    return Decision(Verdict.CONTINUE, "resizing: waiting for workers to stop at a step boundary")
