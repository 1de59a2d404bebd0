"""Restart policy as pure functions: what the agent does after each look at its workers.

The agent loop (``elastic_agent.py``) gathers facts — worker group state, drain flags,
membership, hang, failure attribution, budget — and ``decide`` returns one ``Decision``
with a human-readable reason. Policy in one line each:

- Membership changes never spend the restart budget.
- A worker failure spends one unit, after an exponential backoff; only the node whose
  failure came first (the root cause) spends it, its peers' failures are membership.
- A hang (no rank advanced for ``hang_timeout_s`` after the first step) is a failure.
- A drain stops at the next step boundary; a second signal or the grace period running
  out stops hard.
- Exit code 2 on the first start (argument parsing) is not retried: it will not go away.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    CONTINUE = "continue"  # keep monitoring
    START_DRAIN = "start_drain"  # ask workers to stop at the next step
    RESTART_MEMBERSHIP = "restart_membership"  # re-rendezvous, budget untouched
    RESTART_FAILURE = "restart_failure"  # back off, spend budget, re-rendezvous
    ATTRIBUTE = "attribute"  # a failure: wait for peers' reports before deciding
    FENCE = "fence"  # our lease is gone: kill workers now, rejoin as a new member
    LEAVE = "leave"  # drained: leave the rendezvous and exit 0
    HARD_STOP = "hard_stop"  # drain grace over / second signal: kill workers, leave
    FINISH = "finish"  # the job completed
    FAIL = "fail"  # budget exhausted or non-retryable: exit non-zero


@dataclass(frozen=True)
class Facts:
    """Everything ``decide`` looks at, gathered by the agent loop in one tick."""

    group_state: str  # torch WorkerState name: HEALTHY, SUCCEEDED, FAILED, UNHEALTHY
    drain_signals: int = 0  # SIGTERM/SIGINT received (and notices)
    draining: bool = False  # drain already requested from the workers
    drain_deadline_passed: bool = False
    stopped_for_drain: bool = False  # workers left stopped-<rank> markers
    lease_lost: bool = False
    nodes_waiting: int = 0
    hang: bool = False
    attribution: str = ""  # "", "membership", "root", "victim", "undecided"
    attribution_window_passed: bool = False
    remaining_restarts: int = 0
    exit_codes: tuple[int, ...] = ()
    first_start: bool = True  # this worker group is the first one started on this node
    any_progress: bool = False  # some rank reported a step in this worker group


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str


def decide(f: Facts) -> Decision:
    """Map one tick's facts to the next action. Pure; precedence is top to bottom."""
    if f.lease_lost:
        return Decision(Verdict.FENCE, "lease lost: the job moved on without us; rejoining")
    if f.draining and (f.drain_signals >= 2 or f.drain_deadline_passed):
        why = "second stop signal" if f.drain_signals >= 2 else "drain grace period over"
        return Decision(Verdict.HARD_STOP, f"{why}: stopping workers hard")
    if f.drain_signals and not f.draining:
        return Decision(Verdict.START_DRAIN, "stop requested: workers stop at the next step")

    state = f.group_state
    if state == "SUCCEEDED":
        if f.draining:
            return Decision(Verdict.LEAVE, "workers stopped for our drain: leaving the job")
        if f.stopped_for_drain:
            return Decision(Verdict.RESTART_MEMBERSHIP, "workers stopped for a peer's drain")
        return Decision(Verdict.FINISH, "all workers succeeded")
    if state in ("FAILED", "UNHEALTHY"):
        if f.draining:
            return Decision(Verdict.LEAVE, "workers exited with errors during our drain: leaving")
        if f.first_start and not f.any_progress and 2 in f.exit_codes:
            return Decision(Verdict.FAIL, "exit code 2 on the first start (bad arguments?): not retrying")
        if f.attribution in ("membership", "victim"):
            return Decision(Verdict.RESTART_MEMBERSHIP, f"worker failure caused by a peer ({f.attribution})")
        if f.attribution == "root" or f.attribution_window_passed:
            if f.remaining_restarts > 0:
                return Decision(Verdict.RESTART_FAILURE, "worker failure: restarting")
            return Decision(Verdict.FAIL, "worker failure and the restart budget is spent")
        return Decision(Verdict.ATTRIBUTE, "worker failure: waiting to see whether a peer caused it")
    if state == "HEALTHY":
        if f.hang:
            if f.remaining_restarts > 0:
                return Decision(Verdict.RESTART_FAILURE, "workers hung: restarting")
            return Decision(Verdict.FAIL, "workers hung and the restart budget is spent")
        if f.nodes_waiting > 0 and not f.draining:
            return Decision(Verdict.RESTART_MEMBERSHIP, "membership changed")
        return Decision(Verdict.CONTINUE, "healthy")
    return Decision(Verdict.CONTINUE, f"worker group {state}")
