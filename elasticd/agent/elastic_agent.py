"""``ElasticdAgent``: torch's ``LocalElasticAgent`` with elasticd's supervision loop.

torch's agent starts, stops and monitors the workers (torchrun's environment contract,
error files, log tee). We replace its ``_invoke_run`` loop, because torch's loop:

- spends the restart budget when a worker fails because a *peer* died (survivors' gloo
  collectives fail ~30 ms after a SIGKILL, long before any lease expires);
- never looks at peers while its own workers look healthy, so a frozen peer leaves
  survivors inside an all-reduce until the 30-minute process-group timeout;
- treats SIGTERM as a crash (no drain, no explicit leave).

The loop gathers facts each tick (reads only: the watch cache, the control dir, the
progress board) and asks ``policy.decide`` what to do; the act step then does the tick's
writes (failure report, progress, beat: ``ticks.py``) and carries out the verdict, so a slow etcd
delays the act step, never the look. The loop's state is one ``AgentPhase`` value
(``supervision.py``), replaced on each transition. Signal handlers only bump counters;
all work happens here, between ticks.
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any

import structlog
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

from elasticd.agent.commits import CommitRetrier
from elasticd.agent.policy import (
    REFORM_TIMED_OUT,
    STARTUP_S,
    Decision,
    Facts,
    GroupState,
    Verdict,
    decide,
)
from elasticd.agent.recorder import JobRecorder
from elasticd.agent.reform import LIVE_VERDICTS, LiveReformation, LiveReformer, PlainScriptWatch
from elasticd.agent.standbys import StandbyCare
from elasticd.agent.summary import failure_line, failure_summary, print_summary
from elasticd.agent.supervision import AgentPhase, Outcome, SupervisionSettings
from elasticd.agent.ticks import TickWriter
from elasticd.agent.wakeup import TickWaker
from elasticd.agent.warm import StandbyPool, past_imports, warm_handlers
from elasticd.agent.worker_env import spawn_environment, supervised_worker_env
from elasticd.agent.worker_exec import request_stacks
from elasticd.agent.worker_group import TorchWorkerGroup, drop_torn_error_files
from elasticd.control import ControlChannel
from elasticd.control.api import ENV_ROUND
from elasticd.errors import LeaseLostError, TransientError
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler
from elasticd.rendezvous.etcd_store import RoundAbandonedError
from elasticd.rendezvous.protocol import (
    EJECTIONS,
    LEFT_DRAINED,
    LEFT_FINISHED,
    Attribution,
    MembershipChange,
    attribute_failure,
)
from elasticd.retry import restart_backoff_s

log = structlog.get_logger(__name__)
# Verdicts not logged as a decision: nothing changes (live steps log their own events).
_QUIET = (Verdict.CONTINUE, Verdict.LIVE_WAIT)


class ElasticdAgent(LocalElasticAgent):
    """LocalElasticAgent driven by elasticd's policy (see module docstring)."""

    def __init__(self, spec: Any, settings: SupervisionSettings, handler: EtcdRendezvousHandler,
                 control: ControlChannel, recorder: JobRecorder, *, logs_specs: Any,
                 metrics: Any = None, notifier: Any = None, exit_barrier_timeout: float = 60,
                 commits: CommitRetrier | None = None, standby: StandbyPool | None = None) -> None:
        super().__init__(spec, logs_specs=logs_specs, start_method="spawn",
                         exit_barrier_timeout=exit_barrier_timeout)
        self.settings = settings
        self.handler = handler
        self.control = control
        self.recorder = recorder
        self.metrics = metrics
        self.notifier = notifier
        self.outcome = Outcome()
        self.commits = commits  # checkpoint commits etcd has not answered yet
        self.stop_signals = 0
        self.notice: str | None = None
        self.phase = AgentPhase()  # drain / resize / failure / completion: one value
        self._last_decision = ""
        self._log = log.bind(job=handler.keys.job, node=handler.node_id)
        # The first standbys may have started before torch was imported (agent.early).
        self.standby = standby if standby is not None else StandbyPool(settings.warm_start, control.dir)
        self.standbys = StandbyCare(settings, handler, control, self.standby, self._worker_pids, self._log)
        self.plain_watch = PlainScriptWatch(past_imports)
        self.ticks = TickWriter(settings, handler, control, recorder, self._worker_group,
                                metrics=metrics, notifier=notifier, log=self._log,
                                worker_pids=self._worker_pids)
        self._worker_envs: dict[int, dict[str, str]] = {}
        self._group_started_at = 0.0
        self._done_checked_at = 0.0  # throttle of the done-marker look while workers run
        # Failed attempts while none got past start-up (policy.repeats_at_startup).
        self._startup_failures: tuple[str, ...] = ()
        self._past_startup = False
        self.live = LiveReformation(
            LiveReformer(control, enabled=settings.live_reform,
                         timeout_s=settings.live_reform_timeout_s),
            handler, control, recorder,
            TorchWorkerGroup(self._worker_group, self._join_round, self._worker_pids,
                             lambda: self.handler.round))
        # A stop signal, a worker's exit or a watch event ends the tick's wait at once.
        self.waker = TickWaker()
        handler.on_view_change(self.waker.wake)
        control.on_ping = self.waker.wake  # a live worker parked (elasticd.worker.live)

    # -- signals: flags only -------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        # Plain assignments only: no lock may be taken in a signal handler.
        self.stop_signals += 1
        self.handler.stop_requested = f"{signal.Signals(signum).name} received"

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def request_drain(self, reason: str) -> None:
        """Start a drain from another thread (a preemption notice)."""
        self.notice = reason
        self.stop_signals = max(self.stop_signals, 1)
        self.handler.stop_requested = reason
        self.waker.wake()

    def spare_waiting(self, spare: bool) -> None:
        """The handler's news that this node waits as a hot spare (in its rendezvous, on
        this thread): with ``workers.spare_prebuild`` its standbys start the script now, so
        the imports and the model are done before the admission (``StandbyPool.run_ahead``;
        the round comes at the admission, through ``StandbyPool.take``)."""
        if not spare or not self.settings.spare_prebuild or not self.standby.enabled:
            return
        if self.settings.workers_user:
            self._log.info("spare_prebuild_off", reason="not with workers.user: a worker "
                           "switches user before its round's error file exists")
            return
        from torch.distributed.elastic.utils import macros

        spec = self._worker_group.spec
        n = spec.local_world_size
        static = self._static_worker_env()
        for r in range(n):
            args = (spec.entrypoint, *macros.substitute(list(spec.args), str(r)))
            env = {**os.environ, **static, "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n)}
            self.standby.run_ahead(r, tuple(str(a) for a in args), env)

    # -- hooks into LocalElasticAgent ----------------------------------------------------
    def _static_worker_env(self) -> dict[str, str]:
        """What every worker of this agent gets on top of torch's per-worker variables."""
        losses = self.recorder.observed_losses() if self.settings.checkpoint_every == "auto" else None
        return supervised_worker_env(self.settings, job=self.handler.keys.job,
                                     node=self.handler.node_id, agent_pid=os.getpid(),
                                     control_env=self.control.env(), losses=losses)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.control.clear_round()
        self.live.reformer.reset_group()
        if not self.phase.draining:
            self.control.clear_drain()
        if self.handler.round is None:  # never: torch starts workers after a rendezvous
            raise RuntimeError("starting workers without a round: their commits could not be fenced")
        # The public path: torch starts each worker with a copy of our environment plus its
        # own variables, so the group's variables are set here for the spawn (and secrets
        # removed), not injected through a private torch hook.
        extra = {**self._static_worker_env(), ENV_ROUND: str(self.handler.round)}
        self._worker_envs = {r: {**extra, "LOCAL_RANK": str(r)}
                             for r in range(worker_group.spec.local_world_size)}
        with spawn_environment(extra), warm_handlers(self.standby):
            pids = super()._start_workers(worker_group)
        self._group_started_at = time.monotonic()
        # torch's PContext.start() installs handlers that raise SignalException; a stop
        # signal must start a drain instead.
        self.install_signal_handlers()
        self.phase = self.phase.group_started()  # a resize ends when the re-formed group starts
        return pids

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self._join_round(worker_group)
        self._record_round(worker_group)

    def _join_round(self, worker_group: WorkerGroup) -> None:
        """The rendezvous itself (torch's: ranks, master address); records come after."""
        self._flush_commits("before the next rendezvous", self.settings.drain_grace_s)
        self._set_state("joining")
        try:
            while True:
                try:
                    super()._rendezvous(worker_group)
                    break
                except RoundAbandonedError as exc:
                    # A member left the round as it became final (or a newer round opened):
                    # the rank exchange cannot complete. The next rendezvous sees the round
                    # as used and joins (or opens) the one after it.
                    self._log.warning("round_abandoned", round=self.handler.round, reason=str(exc))
        except RendezvousGracefulExitError as exc:
            # Stopped while waiting for a round: no worker runs, nothing to drain. Leave
            # now (revoking the lease drops our join) instead of after join_timeout.
            # torch's run() catches this error and returns; the runner reads the outcome.
            self._log.info("stopped_while_waiting", reason=str(exc))
            self._leave("drained", str(exc))
            raise

    def _record_round(self, worker_group: WorkerGroup, *, state: str = "training") -> None:
        """The new round's records (node record, event, metrics, systemd status): etcd
        writes a live re-formation makes only after its workers have their order (its node
        state is then ``re-forming`` until they confirmed it)."""
        h = self.handler
        lost_round = h.pop_lease_loss()
        if lost_round is not None:
            self.recorder.event("lease_lost", f"lease lost; round {lost_round} superseded by "
                                f"{h.round}; rejoined", old_round=lost_round)
        ranks = [w.global_rank for w in worker_group.workers]
        self._set_state(state, ranks=ranks, local_world_size=worker_group.spec.local_world_size)
        self.recorder.event("round", f"round {h.round} formed with {worker_group.group_world_size} nodes",
                            world_size=worker_group.group_world_size, ranks=ranks,
                            rendezvous_s=round(h.rendezvous_s, 3))
        if self.metrics is not None:
            self.metrics.set_round(h.round)
            self.metrics.set_world_size((worker_group.group_world_size or 0) * worker_group.spec.local_world_size)
            self.metrics.observe_rendezvous_s(h.rendezvous_s)
        if self.notifier is not None:
            self.notifier.ready()
            self.notifier.status(f"round {h.round}: {len(h.members)} nodes, ranks {ranks}")

    def _record_worker_events(self, result: RunResult) -> None:
        # torch's per-worker event records assume a finished group; ours are in etcd.
        return

    # -- records -------------------------------------------------------------------------
    def _set_state(self, state: str, **changes: Any) -> None:
        try:
            self.handler.update_record(state=state, round=self.handler.round if self.handler.round is not None else -1,
                                       restarts=self._restarts_used(), **changes)
        except (LeaseLostError, TransientError) as exc:
            self._log.warning("node_record_not_updated", state=state, error=str(exc))

    def _restarts_used(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    # -- the loop ------------------------------------------------------------------------
    def _invoke_run(self, role: str = "default") -> RunResult:
        self.waker.install()
        try:
            return self._run_loop()
        finally:
            self.waker.uninstall()

    def _run_loop(self) -> RunResult:
        wg = self._worker_group
        self.install_signal_handlers()
        # Hold a lease before anything slow (the standbys' imports below): an open first
        # round waits for a node that holds one (the start race, issue 25). Usually done
        # already, before torch was imported (elasticd.agent.boot).
        self.handler.arrive()
        self.recorder.event("join", f"node {self.handler.node_id} started")
        # The first workers' standbys import torch while this node waits for its round
        # (a node joining a running job waits for the members to stop their workers).
        static = self._static_worker_env()
        self.standby.fill({r: {**static, "LOCAL_RANK": str(r)} for r in range(wg.spec.local_world_size)},
                          urgent=True)  # nothing of ours trains yet: the node waits for them
        if self.settings.live_reform and self.standby.enabled and self.standbys.joining_running_job():
            # A node joining a running job: members re-forming in place park their workers
            # only from the round on, so join once our workers can start at once.
            self.standbys.wait_for_standbys(wg.spec.local_world_size, lambda: self.stop_signals > 0)
        self._initialize_workers(wg)
        result = RunResult(state=WorkerState.HEALTHY)
        while True:
            # At most one interval; at once on a stop signal, a child's exit, a watch event.
            self.waker.wait(self.settings.monitor_interval_s)
            result = self._monitor(wg)
            wg.state = result.state
            now = time.monotonic()
            facts = self._facts(result, now)
            decision = decide(facts)
            if decision.reason != self._last_decision and decision.verdict not in _QUIET:
                self._log.info("agent_decided", verdict=decision.verdict.value, reason=decision.reason,
                               round=self.handler.round)
            self._last_decision = decision.reason
            self.phase = self.ticks.record(facts, result, self.phase, now)
            self._note_attempt(facts, decision)
            if decision.live_abandoned:
                self.live.abandon(decision)
            if decision.verdict in LIVE_VERDICTS:
                self._act_live(decision, now)
                continue  # the workers re-form in place (elasticd.agent.reform)
            done = self._act(decision, result)
            if done:
                self.standby.close()
                return result
            self.standbys.refill(wg.state, draining=self.phase.draining,
                                 local_world_size=wg.spec.local_world_size,
                                 envs=self._worker_envs, group_started_at=self._group_started_at)

    def _facts(self, result: RunResult, now: float) -> Facts:
        """This tick's decision inputs. Read-only: no etcd write, no phase change (the
        first sight of a failure or of completion is recorded by ``TickWriter.record``)."""
        state = GroupState[result.state.name]
        phase = self.phase
        attribution: Attribution | None = None
        window_passed = False
        if state in (GroupState.FAILED, GroupState.UNHEALTHY) and not phase.draining:
            seen_at = phase.failure_seen_at if phase.failure_seen_at is not None else now
            attribution, _ = self._attribute()
            window_passed = now - seen_at >= self.settings.attribution_window_s
        board = self.control.progress
        hang = bool(self.settings.hang_timeout_s > 0 and board.last_advance > 0
                    and now - board.last_advance > self.settings.hang_timeout_s)
        codes = tuple(f.exitcode for f in result.failures.values()) if result.failures else ()
        waiting = self.handler.membership() if state is GroupState.HEALTHY else None
        nodes_waiting = waiting.count if waiting is not None else 0
        done = self._workers_done(state, now)
        done_at = phase.done_at if phase.done_at is not None else now
        # Stopped markers: when SUCCEEDED, the workers stopped for a drain; when HEALTHY, they
        # are stopping. Globbed only when it can matter (a tick costs no file system scan).
        look_for_markers = state is GroupState.SUCCEEDED or nodes_waiting > 0 or done
        # Drainable markers matter when nodes wait (resize or restart) and on a stop signal.
        asked_to_drain = (self.handler.asked_to_drain()
                          if state is GroupState.HEALTHY and not phase.ejecting else "")
        look_for_drainable = (nodes_waiting > 0 or bool(asked_to_drain)
                              or (self.stop_signals > 0 and not phase.draining))
        starting = self.live.starting(now=now, group_started_at=self._group_started_at,
                                      any_step=board.max_step() >= 0)
        registered_after = self.live.registered_after(now=now, group_started_at=self._group_started_at)
        return Facts(
            group_state=state,
            drain_signals=self.stop_signals,
            draining=phase.draining,
            drain_deadline_passed=phase.draining and phase.deadline_passed(now),
            stopped_for_drain=bool(self.control.stopped_markers()) if look_for_markers else False,
            lease_lost=self.handler.lease_lost.is_set(),
            ejected=(waiting.reason if waiting is not None and waiting.kind in EJECTIONS
                     and self.handler.node_id in waiting.nodes else ""),
            asked_to_drain=asked_to_drain,
            ejecting=phase.ejecting,
            eject_deadline_passed=phase.ejecting and phase.deadline_passed(now),
            nodes_waiting=nodes_waiting,
            membership=waiting.kind if waiting is not None and nodes_waiting else MembershipChange.NONE,
            membership_reason=waiting.reason if waiting is not None and nodes_waiting else "",
            resize_enabled=self.settings.resize_grace_s > 0,
            workers_drainable=look_for_drainable and self.control.workers_drainable(),
            resizing=phase.resizing,
            resize_deadline_passed=phase.resizing and phase.deadline_passed(now),
            hang=hang,
            attribution=attribution,
            attribution_window_passed=window_passed,
            remaining_restarts=self._remaining_restarts,
            exit_codes=codes,
            first_start=phase.groups_started <= 1,
            any_progress=board.max_step() >= 0,
            workers_done=done,
            done_exit_passed=done and now - done_at >= self.settings.done_exit_s,
            failure_line=self._root_failure_line(result),
            startup_failures=self._startup_failures,
            past_startup=(self._past_startup or board.max_step() >= 0
                          or now - self._group_started_at >= STARTUP_S),
            live=self.live.facts(now),
            live_starting=starting,
            group_age_s=now - self._group_started_at,
            registered_after_s=registered_after,
            # Read only while it can matter: a first group that may still register.
            workers_plain=(starting and registered_after is None and phase.groups_started <= 1
                           and self.plain_watch.plain(now=now, group_started_at=self._group_started_at,
                                                      pids=self._worker_pids().values(),
                                                      on_api=self.control.workers_on_api)),
        )

    @staticmethod
    def _root_failure_line(result: RunResult) -> str:
        if not result.failures:
            return ""
        _, failure = min(result.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
        return failure_line(failure)

    def _note_attempt(self, facts: Facts, decision: Decision) -> None:
        """Remember how an attempt failed while none has got past start-up."""
        if facts.past_startup:
            self._past_startup, self._startup_failures = True, ()
        elif (decision.verdict is Verdict.RESTART_FAILURE or decision.spends_budget) \
                and facts.failure_line:
            self._startup_failures = (*self._startup_failures, facts.failure_line)

    def _workers_done(self, state: GroupState, now: float) -> bool:
        """True once every local worker's script returned with 0 (``done-<rank>`` markers).

        Looked at on every tick once the group ended, and once a second while it runs (a
        worker stuck in torch's teardown after its script returned shows up that way).
        """
        if self.phase.done_at is not None:
            return True
        if state is GroupState.HEALTHY and now - self._done_checked_at < 1.0:
            return False
        self._done_checked_at = now
        return self.control.done_count() >= self._worker_group.spec.local_world_size

    def _attribute(self) -> tuple[Attribution, str]:
        rnd = self.handler.round if self.handler.round is not None else -1
        # A peer whose agent is proven gone (a refused liveness probe: SIGKILL, crash) is a
        # membership change now, not when its lease expires (plain scripts: issue 14 item 5).
        return attribute_failure(self.handler.view(), rnd, self.handler.node_id,
                                 proven_dead=self.handler.probe_members())


    def _act_live(self, decision: Decision, now: float) -> None:
        """Carry out a live re-formation verdict: the workers keep running."""
        v = decision.verdict
        if v is Verdict.LIVE_WAIT:
            return
        if v is Verdict.PARK:
            self.live.park(decision.reason, now)
        elif v is Verdict.LIVE_DONE:
            self.live.completed(now - (self.phase.fault_at or now))
            self._set_state("training")  # the record said re-forming since the order
        elif v is Verdict.LIVE_FALLBACK:
            self.live.fell_back(decision.reason)
            if decision.reason == REFORM_TIMED_OUT:
                self._dump_stacks()  # where they hung, in the log (worker_output lines)
            self.phase = self.phase.fault(now)
            # The workers already had live_reform_timeout_s and are stuck (frozen, or in a
            # collective with a dead peer): torch's stop would give them 30 s more for a
            # SIGTERM they cannot act on, and the whole job waits for this node meanwhile.
            self._close_workers(signal.SIGTERM, timeout_s=self.settings.plain_stop_s)
            self._restart("membership", f"live re-formation fell back: {decision.reason}")
        else:
            assert v is Verdict.REFORM_LIVE, v
            self.phase = self.phase.fault(time.monotonic())
            self.live.reform(decision.reason, draining=self.phase.draining)
            self.phase = self.phase.group_started()  # as for a restarted group: a resize ends
            self._group_started_at = time.monotonic()
            # The round's etcd records only now, after the order: the node is "re-forming"
            # until every worker confirmed the new round (LIVE_DONE).
            self._record_round(self._worker_group, state="re-forming")

    def _monitor(self, wg: WorkerGroup) -> RunResult:
        """torch's ``_monitor_workers``, once more after dropping torn worker error files
        (``worker_group.drop_torn_error_files``: torch parses them uncaught)."""
        try:
            return self._monitor_workers(wg)
        except ValueError:  # json.JSONDecodeError, from torch's ProcessFailure
            files = self._pcontext.error_files if self._pcontext is not None else {}
            dropped = drop_torn_error_files(files)
            if not dropped:
                raise
            self._log.warning("worker_error_file_torn", local_ranks=dropped,
                              reason="not valid JSON (the worker stopped while writing it): "
                                     "its failure is read from its exit status")
            return self._monitor_workers(wg)

    def _worker_pids(self) -> dict[int, int]:
        return dict(self._pcontext.pids()) if self._pcontext is not None else {}

    def _act(self, decision: Decision, result: RunResult) -> bool:
        """Carry out one decision. Returns True when the run is over."""
        v, wg = decision.verdict, self._worker_group
        if v is Verdict.CONTINUE or v is Verdict.ATTRIBUTE:
            return False
        if v is Verdict.START_DRAIN:
            self._start_drain(decision.reason)
            return False
        if v is Verdict.START_RESIZE:
            self._start_resize(decision.reason)
            return False
        if v is Verdict.FENCE:
            self._fence(decision.reason)
            return False
        if v is Verdict.START_EJECT_DRAIN:
            self._start_eject_drain(decision.reason)
            return False
        if v is Verdict.EJECTED:
            self._ejected(decision.reason)
            return False
        if v is Verdict.RESTART_MEMBERSHIP:
            self.phase = self.phase.fault(time.monotonic())
            self._restart("membership", decision.reason)
            return False
        if v is Verdict.RESTART_IN_ROUND:
            self._restart_in_round(decision)
            return False
        if v is Verdict.RESTART_FAILURE:
            cause = "hang" if result.state == WorkerState.HEALTHY else "failure"
            if cause == "hang":
                self._dump_stacks()
                self.recorder.event("hang", f"no step for {self.settings.hang_timeout_s:.0f}s")
            delay = self._spend_restart(cause)
            self._stop_workers(wg)
            self._sleep_interruptible(delay)
            self.phase = self.phase.fault(time.monotonic())
            self._restart(cause, decision.reason)
            return False
        if v is Verdict.HARD_STOP:
            self._log.warning("workers_stopped_hard", reason=decision.reason)
            self._close_workers(signal.SIGTERM, timeout_s=5)
            self._leave("drained", decision.reason)
            return True
        if v is Verdict.STOP_NOW:
            self._stop_now(decision.reason)
            return True
        if v is Verdict.LEAVE:
            if result.state == WorkerState.HEALTHY:  # done, but stuck in torch's teardown
                self._close_workers(signal.SIGKILL, timeout_s=1)
            self._leave("drained", decision.reason)
            return True
        if v is Verdict.FINISH:
            # Closed first: the flush and the exit barrier take seconds, and meanwhile a
            # peer that lost its lease would read as lost and reopen the job for joiners.
            self.handler.mark_finished()
            self._flush_commits("before finishing", self.settings.drain_grace_s)
            if result.state == WorkerState.HEALTHY:  # done, but stuck in torch's teardown
                self._close_workers(signal.SIGKILL, timeout_s=1)
            self.handler.leave_kind = LEFT_FINISHED
            self._set_state("stopped")
            self.recorder.event("finished", "workers succeeded")
            self._exit_barrier()
            self.outcome = Outcome("finished", decision.reason)
            return True
        if v is Verdict.FAIL:
            self._stop_workers(wg)
            wg.state = WorkerState.FAILED
            self._set_state("failed", last_exit=decision.reason)
            self.recorder.event("failure", f"giving up: {decision.reason}")
            self.outcome = Outcome("failed", decision.reason, dict(result.failures),
                                   code=decision.exit_code)
            return True
        raise AssertionError(f"unhandled verdict {v}")

    def _restart(self, cause: str, reason: str) -> None:
        self._set_state("restarting")
        self.recorder.event("restart", reason, cause=cause)
        if self.metrics is not None:
            self.metrics.restart(cause)
        self._restart_workers(self._worker_group)

    def _spend_restart(self, cause: str) -> float:
        """One unit of the restart budget; returns the backoff before the next start (logged)."""
        attempt = self._restarts_used() + 1
        self._remaining_restarts -= 1
        delay = restart_backoff_s(attempt, self.settings.restart_backoff_s,
                                  self.settings.restart_backoff_max_s)
        self._log.info("restart_backoff", seconds=delay, attempt=attempt, cause=cause)
        return delay

    def _restart_in_round(self, decision: Decision) -> None:
        """Our workers failed while the job re-forms live in the round we joined: start
        them cold in that round, without a rendezvous (``policy._failed_while_reforming``).

        The worker group already holds the round's ranks and bootstrap address (the
        rendezvous of ``LiveReformation.reform``), so the new workers join the group the
        peers form, and the survivors send them the state, as to a joiner's workers.
        """
        wg = self._worker_group
        cause = "failure" if decision.spends_budget else "membership"
        # Our workers still alive wait in the new round's group for the dead one: a SIGTERM
        # they cannot act on there would cost the whole job torch's 30 s.
        self._close_workers(signal.SIGTERM, timeout_s=self.settings.plain_stop_s)
        if decision.spends_budget:
            self._sleep_interruptible(self._spend_restart(cause))
        self.phase = self.phase.fault(time.monotonic())
        self.live.restarted_in_round(decision.reason)
        self._set_state("restarting")
        self.recorder.event("restart", decision.reason, cause=cause)
        if self.metrics is not None:
            self.metrics.restart(cause)
        wg.state = WorkerState.STOPPED
        pids = self._start_workers(wg)
        for w in wg.workers:  # torch's monitor matches workers to processes by id
            w.id = pids.get(w.local_rank)
        wg.state = WorkerState.HEALTHY
        self._set_state("training", ranks=[w.global_rank for w in wg.workers],
                        local_world_size=wg.spec.local_world_size)

    def _start_resize(self, reason: str) -> None:
        """Ask the workers to stop at the next step so that joiners are admitted; we stay.

        The drain file is the same as for a drain, but the phase is ``RESIZING``, not
        ``DRAINING`` (which means "this node leaves"). The workers exit 0 with stopped
        markers and the policy re-forms the job (``RESTART_MEMBERSHIP``); ``_start_workers``
        ends the resize.
        """
        self.phase = self.phase.resize(time.monotonic() + self.settings.resize_grace_s)
        self.control.request_drain(f"resize: {reason}")
        self.recorder.event("resize", reason, grace_s=self.settings.resize_grace_s)
        self._log.info("resize_started", reason=reason, grace_s=self.settings.resize_grace_s,
                       round=self.handler.round)

    def _start_drain(self, reason: str) -> None:
        # A stop signal during a resize: the stop becomes our drain.
        self.phase = self.phase.drain(time.monotonic() + self.settings.drain_grace_s)
        why = self.notice or f"stop signal ({reason})"
        self.control.request_drain(why)
        self._set_state("draining")
        self.recorder.event("drain", why, grace_s=self.settings.drain_grace_s)
        if self.notifier is not None:
            self.notifier.stopping()
            self.notifier.status(f"draining: {why}")
        self._log.info("drain_started", reason=why, grace_s=self.settings.drain_grace_s)

    def _stop_now(self, reason: str) -> None:
        """A stop the workers cannot honour at a step boundary: SIGTERM them, leave.

        Their own SIGTERM handler (a plain script's, torch's) gets ``plain_stop_s``, then
        SIGKILL. The node is gone within seconds of the signal, so its peers re-form at
        once instead of training on for the drain grace with a node that is leaving.
        """
        # No grace: the workers are stopped now (and pending commits get none either).
        self.phase = self.phase.drain(0.0)
        why = self.notice or "stop signal"
        self.recorder.event("drain", f"{why}: workers cannot drain, stopped now",
                            plain_stop_s=self.settings.plain_stop_s)
        if self.notifier is not None:
            self.notifier.stopping()
            self.notifier.status(f"stopping: {why}")
        self._log.info("workers_stopped_now", reason=why, plain_stop_s=self.settings.plain_stop_s)
        self._close_workers(signal.SIGTERM, timeout_s=self.settings.plain_stop_s)
        self._leave("drained", reason)

    def _fence(self, reason: str) -> None:
        """Our lease is gone: kill workers now (no step of theirs may write), rejoin fresh."""
        old_round = self.handler.round
        if self.handler.try_resurrect():
            self.recorder.event("lease_lost", f"lease expired during an etcd outage; "
                                f"re-registered in round {old_round}; workers kept", old_round=old_round)
            self._set_state("training")
            return
        self._close_workers(signal.SIGKILL, timeout_s=5)
        view = self.handler.view()
        current = view.state.round if view.state else old_round
        msg = f"lease lost; round {old_round} superseded by {current}; rejoining"
        self._log.warning("lease_lost_rejoining", round=old_round, current_round=current)
        self.phase = self.phase.fault(time.monotonic())
        self._worker_group.state = WorkerState.STOPPED
        self._log.warning("lease_lost", message=msg)
        self._initialize_workers(self._worker_group)  # re-registers a new lease first

    def _start_eject_drain(self, reason: str) -> None:
        """The coordinator put us on probation as a straggler: our workers stop at the next
        agreed step with everyone's (the drain file, as for a drain; with live re-formation
        a drained worker exits there and the others re-form without it), then ``_ejected``
        rejoins us as a spare. Bounded by the drain grace; the coordinator's own bound
        (``stragglers.drain_bound_s``) is shorter and ejects us the hard way."""
        self.phase = self.phase.eject(time.monotonic() + self.settings.drain_grace_s)
        self.control.request_drain(f"ejected as a straggler: {reason}")
        self._log.warning("straggler_drain_started", reason=reason, round=self.handler.round)

    def _ejected(self, reason: str) -> None:
        """The coordinator ejected us (our workers hang the job, or we are a straggler it
        put on probation): kill them (after a straggler's drain, whatever is left of
        them), rejoin cold (a straggler waits as a spare until its probation ends).

        SIGKILL to each worker's whole process group (its own session): a stopped
        (SIGSTOPped) or GIL-bound worker never honours a SIGTERM, and its children (data
        loaders) must not outlive it. No restart budget: a membership change. We rejoin
        the round after the one the others re-formed in (``protocol.ejected``).
        """
        waiting = self.handler.membership()
        straggler = self.phase.ejecting or waiting.kind is MembershipChange.MEMBER_SLOW \
            or bool(self.handler.asked_to_drain())
        kind = "straggler_ejected" if straggler else "hung"
        if kind == "hung":
            self._dump_stacks()  # where they hung, in the workers' stderr (a SIGSTOPped one: none)
        self.recorder.event(kind, f"node {self.handler.node_id} ejected: {reason}",
                            node=self.handler.node_id, round=self.handler.round)
        self._log.warning("node_ejected", reason=reason, round=self.handler.round)
        self._close_workers(signal.SIGKILL, timeout_s=1)  # torch's close: killpg of each worker
        self.phase = self.phase.fault(time.monotonic())
        # Rejoin once our next workers can start at once: the members park for a joiner
        # and wait for its workers, so a cold import (seconds to tens of seconds) would
        # stall the whole job again (the others train at world N-1 meanwhile).
        n = self._worker_group.spec.local_world_size
        if self.standby.enabled:
            # A straggler waits out its probation anyway: its refill stays at nice 19 (on a
            # shared machine it would slow the others' first steps without it).
            urgent = kind == "hung"
            self.standby.fill(dict(self._worker_envs), urgent=urgent)  # nothing of ours trains
            if urgent:
                self.standby.hurry()  # a refill started beside the workers imports at nice 19
            self.standbys.wait_for_standbys(n, lambda: self.stop_signals > 0)
        self._restart("hang", reason)

    def _flush_commits(self, why: str, timeout_s: float) -> None:
        """Wait (bounded) for checkpoint commits etcd has not answered yet.

        A new round changes the round state, which fences out every commit of the old
        round, and leaving revokes our lease: either would turn a save that is merely
        waiting for etcd into a lost one. Skipped once our lease is lost for good (we are
        the zombie then: the new round refuses the old commit, as it must). A lease lost
        *while* we wait (etcd away) is re-registered in our round at once if it may be
        (``try_resurrect``), and the wait goes on; otherwise the wait ends. Why: the
        agent's loop is blocked here, and waiting out the coordinator's outage grace made
        the job re-form without us from an older checkpoint (soak seed 777002: a step
        trained twice, the commit refused anyway).
        """
        if self.commits is None or self.commits.pending() is None or self.handler.lease_lost.is_set():
            return
        self._log.info("checkpoint_commits_flushing", why=why, timeout_s=round(timeout_s, 1))
        end = time.monotonic() + max(timeout_s, 0.0)
        while not self.commits.flush(max(end - time.monotonic(), 0.0), stop=self.handler.lease_lost):
            if time.monotonic() >= end or not self.handler.lease_lost.is_set() \
                    or not self.handler.try_resurrect():
                self._log.warning("checkpoint_commits_still_pending", why=why,
                                  lease_lost=self.handler.lease_lost.is_set())
                return

    def _leave(self, kind: str, reason: str) -> None:
        self.handler.leave_kind = LEFT_DRAINED  # a leave, not a loss: peers re-form at once
        self._flush_commits("before leaving", max(self.phase.deadline - time.monotonic(), 0.0)
                            if self.phase.draining else self.settings.drain_grace_s)
        self._set_state("stopped")
        self.recorder.event("leave", reason)
        self.outcome = Outcome(kind, reason)
        self.handler.shutdown()  # revoke the lease: peers re-form at once, no TTL wait

    def _close_workers(self, sig: signal.Signals, timeout_s: float) -> None:
        if self._pcontext is not None:
            # torch waits whole seconds (then SIGKILLs): round up, never below 1.
            self._pcontext.close(death_sig=sig, timeout=max(math.ceil(timeout_s), 1))

    def _dump_stacks(self) -> None:
        # worker_exec registered faulthandler on SIGUSR1: stacks go to the workers' stderr.
        if self._pcontext is not None:
            request_stacks(self._pcontext.pids().values())

    def _sleep_interruptible(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.stop_signals:
            time.sleep(min(0.1, end - time.monotonic()))


__all__ = ["ElasticdAgent", "Outcome", "SupervisionSettings", "failure_summary", "print_summary"]
