"""The agent loop's writes of a tick, done in the act step (never while gathering facts).

``TickWriter``, one of ``ElasticdAgent``'s collaborators: a failure's first sight (reported to etcd, where the peers'
attribution reads it), the first sight of completion, the job's progress (with the loss
the local ranks reported), the node's beat and the systemd watchdog. Kept apart from the
loop because they are the loop's only etcd writes per tick: a slow etcd delays them, and
nothing else.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from elasticd.agent.policy import Facts, GroupState, LivePhase
from elasticd.agent.recorder import JobRecorder
from elasticd.agent.summary import first_failure
from elasticd.agent.supervision import AgentPhase, SupervisionSettings
from elasticd.control import ControlChannel
from elasticd.errors import LeaseLostError, TransientError
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
from elasticd.rendezvous.hangs import ProcActivity, WorkerActivity
from elasticd.rendezvous.stragglers import BusyShare

if TYPE_CHECKING:
    from elasticd.agent.sdnotify import SystemdNotifier
    from elasticd.status.metrics import AgentMetrics

# The beat is rewritten on a change of the step or the workers' activity, at most this
# often (the coordinator's hang facts); unchanged, every ``beat_interval_s``.
BEAT_MIN_INTERVAL_S = 1.0
ACTIVITY_SAMPLE_S = 0.5  # /proc is read at most this often
STEP_WINDOW_S = 10.0  # the node's step time is measured over this window


class StepClock:
    """A node's recent seconds per step, from when its newest step changed (pure memory)."""

    def __init__(self, window_s: float = STEP_WINDOW_S) -> None:
        self.window_s = window_s
        self._marks: deque[tuple[float, int]] = deque()

    def observe(self, step: int, now: float) -> None:
        if step < 0:
            self._marks.clear()
            return
        if self._marks and step < self._marks[-1][1]:
            self._marks.clear()  # a new worker group resumed from an older step
        if not self._marks or step > self._marks[-1][1]:
            self._marks.append((now, step))
        while len(self._marks) > 2 and now - self._marks[0][0] > self.window_s:
            self._marks.popleft()

    def step_s(self) -> float:
        """Seconds per step over the window (0.0: fewer than two steps seen)."""
        if len(self._marks) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._marks[0], self._marks[-1]
        return (t1 - t0) / (s1 - s0)


class TickWriter:
    """The act step's per-tick writes.

    Args:
        settings: the agent's supervision settings (the beat interval).
        handler: the rendezvous handler (failure reports).
        control: the control channel (the progress board).
        recorder: the job's records (events, progress, beats).
        group: the agent's worker group (its rank, sizes and state).
        metrics: the agent's Prometheus metrics, or None.
        notifier: the systemd notifier, or None.
        log: the agent's bound logger.
        worker_pids: the running workers' pids by local rank (their activity in the beat).
    """

    def __init__(self, settings: SupervisionSettings, handler: EtcdRendezvousHandler,
                 control: ControlChannel, recorder: JobRecorder, group: WorkerGroup, *,
                 metrics: AgentMetrics | None, notifier: SystemdNotifier | None,
                 log: structlog.typing.FilteringBoundLogger,
                 worker_pids: Callable[[], dict[int, int]] = dict) -> None:
        self.settings = settings
        self.handler = handler
        self.control = control
        self.recorder = recorder
        self.group = group
        self.metrics = metrics
        self.notifier = notifier
        self._log = log
        self.phase = AgentPhase()  # of the tick being recorded (see record)
        self.last_heartbeat = 0.0
        self.worker_pids = worker_pids
        self.activity = ProcActivity()
        self.steps = StepClock()
        self.busy = BusyShare()
        self._activity = WorkerActivity.UNKNOWN
        self._activity_at = 0.0
        self._beaten: tuple[int, int | None, WorkerActivity] | None = None  # step, round, activity

    def record(self, facts: Facts, result: RunResult, phase: AgentPhase, now: float) -> AgentPhase:
        """The tick's writes, before its verdict is carried out: a failure's first sight
        (reported to etcd, where the peers' attribution reads it), the first sight of
        completion, progress and the heartbeat. Before the verdict, because a restart
        moves this node to the next round.

        Returns:
            ``phase`` with what this tick saw first (a failure, completion, a recovery).
        """
        self.phase = phase
        failed = facts.group_state in (GroupState.FAILED, GroupState.UNHEALTHY)
        if failed and not facts.draining and self.phase.failure_seen_at is None:
            self.phase = self.phase.failure_seen(now)
            self._report_failure(result)
        if facts.workers_done and self.phase.done_at is None:
            self.phase = self.phase.done(now)
        self._heartbeat(now, reforming=facts.live is not None and facts.live.phase is LivePhase.REFORMING)
        return self.phase

    def _report_failure(self, result: RunResult) -> None:
        first = first_failure(result)
        detail = f"rank {first[0]}: {first[1]}" if first else "worker failure"
        try:
            self.handler.report_failure(detail)
        except (TransientError, LeaseLostError) as exc:
            self._log.warning("failure_report_not_written", error=str(exc))
        self.recorder.event("failure", detail, exit_code=first[2] if first else None)

    def _heartbeat(self, now: float, *, reforming: bool = False) -> None:
        board = self.control.progress
        wg = self.group
        # No progress while the workers re-form in place: the group already has the new
        # round's size, its workers not yet, and a step of the old round reported now (the
        # throttled report of the step they left at) would open the job's history at the
        # new size, charging the whole re-formation pause to it (a join waiting seconds for
        # the joiner's worker: the goodput ledger's "resize", the audit's old world).
        if wg.group_rank == 0 and board.max_step() >= 0 and not reforming:
            snap = board.snapshot()
            top = max(snap.values(), key=lambda p: p.step)
            losses = [p.loss for p in snap.values() if p.loss is not None and p.step == top.step]
            self.recorder.progress(top.step, top.epoch, top.samples_trained,
                                   (wg.group_world_size or 0) * wg.spec.local_world_size,
                                   loss=sum(losses) / len(losses) if losses else None,
                                   cadence=top.cadence, step_s=top.step_s)
            if self.metrics is not None:
                self.metrics.set_step(top.step, samples=top.samples_trained)
        fault_at = self.phase.fault_at
        if fault_at is not None and board.max_step() >= 0 and wg.state == WorkerState.HEALTHY:
            if self.metrics is not None:
                self.metrics.observe_recovery_s(now - fault_at)
            self.phase = self.phase.recovered()
        step = board.max_step()
        self.steps.observe(step, now)
        pids = list(self.worker_pids().values())
        self.busy.observe(self.activity.states(pids) if step >= 0 else [], now)
        if now - self._activity_at >= ACTIVITY_SAMPLE_S:
            self._activity_at = now
            self._activity = self.activity.sample(pids, now)
        facts = (step, self.handler.round, self._activity)
        since = now - self.last_heartbeat
        if since >= self.settings.beat_interval_s or (
                facts != self._beaten and since >= BEAT_MIN_INTERVAL_S):
            # The beat, not the node record: peers watch nodes/, so a periodic record
            # rewrite would cost every peer an event; nobody watches beats/ (the
            # coordinator reads them: its hang facts, rendezvous/coordinator.py).
            self.last_heartbeat = now
            self._beaten = facts
            self.recorder.beat(step, wg.spec.local_world_size, activity=self._activity.value,
                               step_s=self.steps.step_s(), busy_share=self.busy.share())
        if self.notifier is not None:
            self.notifier.watchdog()
