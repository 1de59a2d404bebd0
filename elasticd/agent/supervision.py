"""The values the agent's supervision loop keeps: its settings, its phase, how its run ended.

The loop (``elastic_agent.py``) holds one :class:`AgentPhase` and replaces it on every
transition, rather than flipping a handful of mutable flags whose combinations nobody
wrote down: a drain and a resize exclude each other by construction (``Mode``), and
each transition is a pure method tested without torch or etcd.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure


@dataclass(frozen=True)
class SupervisionSettings:
    """The agent loop's knobs (seconds)."""

    max_restarts: int = 3
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    drain_grace_s: float = 60.0
    plain_stop_s: float = 3.0  # a stop when workers cannot drain: their SIGTERM handler's time
    done_exit_s: float = 30.0  # workers whose script returned must exit within this (then: done)
    resize_grace_s: float = 30.0  # a join drains workers for at most this long; 0 = restart at once
    hang_timeout_s: float = 0.0  # 0 = off
    attribution_window_s: float = 3.0
    monitor_interval_s: float = 0.1
    beat_interval_s: float = 2.0  # how often the node's beat (liveness, step) is written
    checkpoint_url: str | None = None
    checkpoint_every: str = ""  # [checkpoint] every: "auto", steps, or "" (the script's own)
    worker_env: dict[str, str] = field(default_factory=dict)
    warm_start: bool = True  # keep a standby per local rank (see elasticd.agent.warm)
    standby_refill: bool = True  # ... also after the first workers started (StandbyCare.refill)
    spare_prebuild: bool = False  # a hot spare's standbys run the script ahead (StandbyPool.run_ahead)
    standby_delay_s: float = 2.0  # start standbys this long after the group's first step
    standby_after_s: float = 30.0  # ... or this long after the group started (plain scripts)
    live_reform: bool = True  # re-form workers on the worker API in place (elasticd.agent.reform)
    live_reform_timeout_s: float = 30.0  # ... or fall back to a restart after this long
    workers_user: str | None = None  # run workers as this user (elasticd.agent.worker_user)


class Mode(enum.Enum):
    """What the agent has asked of its workers."""

    RUNNING = "running"  # nothing: the workers train (or start)
    # Stop at the next step so that joiners are admitted; this node stays. The workers exit 0
    # with stopped markers, the policy re-forms the job, and the next group's start ends it.
    RESIZING = "resizing"
    DRAINING = "draining"  # this node leaves: the workers stop at the next step (or now)
    # The coordinator ejected this node as a straggler and asked it to drain: the workers
    # stop at the next agreed step with everyone (a pure FSDP2 job's survivors then hold
    # its shards in their replicas of that very step), and the node waits as a spare.
    EJECTING = "ejecting"


@dataclass(frozen=True)
class AgentPhase:
    """Where the agent's supervision of the current worker group stands (monotonic times).

    ``deadline`` is the end of the drain's or the resize's grace (``drain_grace_s``,
    ``resize_grace_s``), or of a straggler's drain (the coordinator's bound); ``failure_seen_at`` the first sight of this group's failure (the
    attribution window runs from it); ``fault_at`` when the current recovery began (for
    the recovery-time metric; it spans restarts); ``done_at`` when every local worker's
    script had returned.
    """

    mode: Mode = Mode.RUNNING
    deadline: float = 0.0
    groups_started: int = 0
    failure_seen_at: float | None = None
    fault_at: float | None = None
    done_at: float | None = None

    @property
    def draining(self) -> bool:
        return self.mode is Mode.DRAINING

    @property
    def resizing(self) -> bool:
        return self.mode is Mode.RESIZING

    @property
    def ejecting(self) -> bool:
        return self.mode is Mode.EJECTING

    def deadline_passed(self, now: float) -> bool:
        """The grace of the drain or resize in progress ran out (False when running)."""
        return self.mode is not Mode.RUNNING and now >= self.deadline

    def group_started(self) -> AgentPhase:
        """A worker group started: a resize ends; failure and completion start afresh."""
        mode = Mode.DRAINING if self.draining else Mode.RUNNING
        return replace(self, mode=mode, groups_started=self.groups_started + 1,
                       failure_seen_at=None, done_at=None)

    def drain(self, deadline: float) -> AgentPhase:
        """This node leaves; a drain during a resize replaces it (the stop becomes ours)."""
        return replace(self, mode=Mode.DRAINING, deadline=deadline)

    def resize(self, deadline: float) -> AgentPhase:
        """Workers stop at the next step for joiners, until ``deadline``."""
        return replace(self, mode=Mode.RESIZING, deadline=deadline)

    def eject(self, deadline: float) -> AgentPhase:
        """Ejected as a straggler: the workers stop at the next agreed step, until ``deadline``."""
        return replace(self, mode=Mode.EJECTING, deadline=deadline)

    def failure_seen(self, now: float) -> AgentPhase:
        """First sight of the group's failure: the attribution window and a recovery begin."""
        return replace(self, failure_seen_at=now, fault_at=self.fault_at or now)

    def fault(self, now: float) -> AgentPhase:
        """A recovery begins now unless one is already under way."""
        return replace(self, fault_at=self.fault_at or now)

    def recovered(self) -> AgentPhase:
        """The workers train again: the recovery is over."""
        return replace(self, fault_at=None)

    def done(self, now: float) -> AgentPhase:
        """Every local worker's script returned (first seen ``now``)."""
        return replace(self, done_at=now)


@dataclass
class Outcome:
    """How the agent's run ended, for the exit code and the one-screen summary."""

    kind: str = "running"  # finished | drained | failed | closed
    reason: str = ""
    failures: dict[int, ProcessFailure] = field(default_factory=dict)  # by global rank
    code: int = 1  # exit status when failed (78: a worker's configuration error)

    @property
    def exit_code(self) -> int:
        return 0 if self.kind in ("finished", "drained", "closed") else self.code
