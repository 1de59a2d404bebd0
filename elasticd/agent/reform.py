"""Live re-formation, agent side: re-form the worker group in place instead of restarting it.

When every local worker registered for live re-formation (``live-<rank>``, written by
``elasticd.worker.LiveState``), a membership change does not kill them. The agent:

- on a node joining, asks them to leave the group at the next agreed step (``park``);
- on a peer lost or drained, or once its workers parked (a collective failed: a peer died,
  which is seen within milliseconds, long before the lease expires), runs the next
  rendezvous round at once while they wait, and writes the new round's ranks and
  bootstrap address to ``reform.json``;
- waits (bounded by ``live_reform_timeout_s``) for every worker to report it re-formed;
  past the bound it falls back to today's restart, with one log line saying why. Workers
  that fail before taking the order (still in the superseded round: a refused commit)
  are restarted the same way, as a membership change (no restart budget spent);
- keeps its node record ``re-forming`` from the order until every worker confirmed, so
  ``elasticd status`` never reports a member as training in a round its workers are not
  in yet.

The decision is the pure function :func:`decide_live`; :class:`LiveReformer` is the thin
part that reads and writes the control directory.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from elasticd.control.api import PARK_FILE, REFORM_FILE
from elasticd.control.messages import LeaveReason, LiveRegistration, ParkedReport, ReformedReport
from elasticd.control.reform import (
    ReformOrder,
    clear_reports,
    live_workers,
    parked,
    reformed,
    write_order,
)

log = structlog.get_logger(__name__)


class LiveVerdict(enum.Enum):
    NONE = "none"  # not a live case: the restart policy decides
    WAIT = "wait"  # a re-formation or a park is under way
    PARK = "park"  # nodes join: workers leave the group at the next agreed step
    REFORM = "reform"  # run the next round now and order the workers into it
    DONE = "done"  # every worker re-formed
    ABANDON = "abandon"  # workers exited mid-way: forget the re-formation, the policy decides
    FALLBACK = "fallback"  # in place failed: restart the workers (today's path)


@dataclass(frozen=True)
class LiveFacts:
    """What :func:`decide_live` looks at (one agent tick)."""

    enabled: bool
    workers_live: bool  # every local worker registered live-<rank>
    group_state: str  # torch WorkerState name
    verdict: str  # the restart policy's verdict for this tick (policy.Verdict value)
    membership: str = ""  # kind of membership change when nodes wait
    draining: bool = False  # this node leaves
    parked_all: bool = False  # every local worker left its group and waits for an order
    parked_any_failure: bool = False  # a local worker's collective failed (a peer died)
    parking: bool = False  # we asked the workers to park
    reforming: bool = False  # an order is out, not every worker confirmed yet
    reformed_all: bool = False  # ... and now every worker confirmed it
    # ... and every worker has left its old group (parked) or re-formed: none of them
    # still runs in the superseded round.
    left_old_all: bool = False
    deadline_passed: bool = False  # the re-formation (or park) bound passed


@dataclass(frozen=True)
class LiveDecision:
    verdict: LiveVerdict
    reason: str


def decide_live(f: LiveFacts) -> LiveDecision:
    """Live re-formation's decision for one tick. Pure; precedence top to bottom."""
    if not f.enabled or not f.workers_live or f.draining:
        return LiveDecision(LiveVerdict.NONE, "not live")
    if f.group_state != "HEALTHY":
        if f.reforming and not f.left_old_all and f.group_state in ("FAILED", "UNHEALTHY"):
            # They failed in the round the order superseded (a zombie's commit is refused
            # there): a consequence of the membership change, which spends no budget.
            return LiveDecision(LiveVerdict.FALLBACK, "workers failed in the superseded round "
                                "before taking the order")
        if f.reforming or f.parking:
            return LiveDecision(LiveVerdict.ABANDON, f"workers ended during the re-formation "
                                f"({f.group_state}): the restart policy decides")
        return LiveDecision(LiveVerdict.NONE, "workers not running")
    if f.verdict not in ("continue", "restart_membership", "start_resize", "attribute"):
        return LiveDecision(LiveVerdict.NONE, f"the policy acts first ({f.verdict})")
    if f.reforming:
        if f.reformed_all:
            return LiveDecision(LiveVerdict.DONE, "every worker re-formed")
        if f.verdict == "restart_membership" and f.membership in ("member_lost", "newer_round"):
            # A second change while the workers form the new group: a member they wait for
            # is gone (or the job moved on), so the group cannot form and waiting for the
            # bound would only delay the restart. (A join waits: it parks after this one.)
            return LiveDecision(LiveVerdict.FALLBACK, f"membership changed again during the "
                                f"re-formation ({f.membership})")
        if f.deadline_passed:
            return LiveDecision(LiveVerdict.FALLBACK, "workers did not re-form within the bound")
        return LiveDecision(LiveVerdict.WAIT, "waiting for workers to re-form")
    if f.parked_any_failure:
        return LiveDecision(LiveVerdict.REFORM, "a collective failed (a peer is gone): "
                            "opening the next round now")
    if f.parked_all:
        return LiveDecision(LiveVerdict.REFORM, "workers left their group at the agreed step")
    joining = f.membership == "join" and f.verdict in ("restart_membership", "start_resize")
    if not joining and f.verdict in ("restart_membership", "start_resize"):
        return LiveDecision(LiveVerdict.REFORM, f"membership changed ({f.membership or 'peer'}): "
                            "re-forming in place")
    if joining:
        # A join parks first, even when the policy would restart (a group that has not
        # trained yet): a worker leaves its group only at an agreed step or on a failed
        # collective, so an order alone never reaches one whose collectives all succeed
        # (a node alone at world size 1 trained on, and was restarted after the bound).
        if f.parking:
            if f.deadline_passed:
                return LiveDecision(LiveVerdict.FALLBACK, "workers did not reach an agreed step "
                                    "within the bound")
            return LiveDecision(LiveVerdict.WAIT, "waiting for workers to park")
        return LiveDecision(LiveVerdict.PARK, "nodes join: workers leave the group at the next step")
    if f.parking:
        return LiveDecision(LiveVerdict.WAIT, "waiting for workers to park")
    return LiveDecision(LiveVerdict.NONE, "no membership change")


class LiveReformer:
    """The control-directory side of live re-formation for one agent.

    Args:
        control_dir: the agent's runtime directory.
        enabled: ``workers.live_reform``.
        timeout_s: bound on one re-formation (and on a park).
    """

    def __init__(self, control_dir: Path, *, enabled: bool, timeout_s: float) -> None:
        self.dir = Path(control_dir)
        self.enabled = enabled
        self.timeout_s = timeout_s
        self.parking = False
        self.reforming_round: int | None = None
        self.deadline = 0.0

    def workers_live(self, local_world_size: int) -> bool:
        return self.enabled and len(live_workers(self.dir)) >= local_world_size

    def facts(self, *, local_world_size: int, group_state: str, verdict: str, membership: str,
              draining: bool, now: float) -> LiveFacts:
        live = self.workers_live(local_world_size) if self.enabled else False
        waiting = parked(self.dir) if live else {}
        done = reformed(self.dir) if live and self.reforming_round is not None else {}
        new_round = {r for r, d in done.items() if d.round == self.reforming_round}
        return LiveFacts(
            enabled=self.enabled, workers_live=live, group_state=group_state, verdict=verdict,
            membership=membership, draining=draining,
            parked_all=live and len(waiting) >= local_world_size,
            parked_any_failure=any(p.reason is LeaveReason.COLLECTIVE_FAILED for p in waiting.values()),
            parking=self.parking, reforming=self.reforming_round is not None,
            reformed_all=self.reforming_round is not None and len(new_round) >= local_world_size,
            left_old_all=self.reforming_round is not None
            and len(new_round | set(waiting)) >= local_world_size,
            deadline_passed=(self.parking or self.reforming_round is not None) and now >= self.deadline,
        )

    def park(self, now: float) -> None:
        (self.dir / PARK_FILE).write_text("join")
        self.parking = True
        self.deadline = now + self.timeout_s

    def order(self, order: ReformOrder, now: float) -> None:
        """Publish the new round to the workers (their parked markers are theirs to clear)."""
        (self.dir / PARK_FILE).unlink(missing_ok=True)
        self.parking = False
        write_order(self.dir, order)
        self.reforming_round = order.round
        self.deadline = now + self.timeout_s

    def finish(self) -> None:
        """The re-formation ended (done or fallen back): forget it."""
        self.parking = False
        self.reforming_round = None
        (self.dir / PARK_FILE).unlink(missing_ok=True)
        clear_reports(self.dir, ReformedReport)

    def reset_group(self) -> None:
        """A new worker group starts (restart path): no live state, no order, no markers."""
        self.finish()
        (self.dir / REFORM_FILE).unlink(missing_ok=True)
        clear_reports(self.dir, LiveRegistration)
        clear_reports(self.dir, ParkedReport)


def live_tick(agent: Any, verdict: str, membership: str) -> bool:
    """Run live re-formation's part of one agent tick.

    Args:
        agent: the ``ElasticdAgent`` (its worker group, handler, control channel).
        verdict: the restart policy's verdict value for this tick.
        membership: the membership change kind (when nodes wait).

    Returns:
        True when live re-formation handled the tick (the policy's action is skipped).
    """
    live: LiveReformer = agent.live
    if not live.enabled:
        return False
    wg = agent._worker_group
    now = time.monotonic()
    d = decide_live(live.facts(local_world_size=wg.spec.local_world_size,
                               group_state=wg.state.name, verdict=verdict, membership=membership,
                               draining=agent.phase.draining, now=now))
    v = d.verdict
    if v is LiveVerdict.NONE:
        return False
    if v is LiveVerdict.WAIT:
        return True
    if v is LiveVerdict.ABANDON:
        agent._log.info("live_reform_abandoned", reason=d.reason)
        live.finish()
        return False
    if v is LiveVerdict.PARK:
        agent._log.info("live_park_requested", reason=d.reason, round=agent.handler.round)
        live.park(now)
        return True
    if v is LiveVerdict.DONE:
        took = now - (agent.phase.fault_at or now)
        agent._log.info("live_reform_completed", round=agent.handler.round, seconds=round(took, 3))
        agent.recorder.event("reform", f"workers re-formed in place in round {agent.handler.round}",
                             seconds=round(took, 3))
        agent._set_state("training")  # the record said re-forming since the order
        live.finish()
        return True
    if v is LiveVerdict.FALLBACK:
        # The one line that says why in place did not work; then today's restart path.
        agent._log.warning("live_reform_fell_back", reason=d.reason, round=agent.handler.round)
        live.reset_group()
        agent.phase = agent.phase.fault(now)
        agent._restart("membership", f"live re-formation fell back: {d.reason}")
        return True
    assert v is LiveVerdict.REFORM
    reform_in_place(agent, d.reason)
    return True


def reform_in_place(agent: Any, reason: str) -> None:
    """Run the next rendezvous round with the workers alive and order them into it."""
    wg, live = agent._worker_group, agent.live
    agent.phase = agent.phase.fault(time.monotonic())
    old_round = agent.handler.round
    agent._log.info("live_reform_started", reason=reason, round=old_round)
    pids = agent._pcontext.pids() if agent._pcontext is not None else {}
    agent._join_round(wg)
    for w in wg.workers:  # torch's monitor matches workers to processes by id
        w.id = pids.get(w.local_rank)
    order = ReformOrder(round=int(agent.handler.round), world_size=int(wg.workers[0].world_size),
                        master_addr=str(wg.master_addr), master_port=int(wg.master_port),
                        ranks={w.local_rank: w.global_rank for w in wg.workers})
    if not agent.phase.draining:
        agent.control.clear_drain()
    agent.control.progress.reset()
    agent.phase = agent.phase.group_started()  # as for a restarted group: a resize ends
    agent._group_started_at = time.monotonic()
    live.order(order, time.monotonic())
    agent._log.info("live_reform_ordered", round=order.round, world_size=order.world_size,
                    ranks=order.ranks, old_round=old_round)
    # The round's etcd records only now: the workers re-form meanwhile (they were on the
    # critical path, 10-70 ms under load, when written before the order). The node is
    # "re-forming" until every worker confirmed the new round (DONE above).
    agent._record_round(wg, state="re-forming")
