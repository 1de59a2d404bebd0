"""Unit tests of the agent's phase value and of its read-only fact gathering (no etcd, no processes)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from elasticd.agent.elastic_agent import ElasticdAgent
from elasticd.agent.policy import GroupState, Verdict, decide
from elasticd.agent.supervision import AgentPhase, Mode, SupervisionSettings
from elasticd.agent.ticks import TickWriter
from elasticd.agent.worker_env import agent_worker_env
from elasticd.control.api import ENV_CHECKPOINT_URL, ENV_JOB
from elasticd.records import RoundState
from elasticd.rendezvous.protocol import Attribution, RendezvousView, Waiting

# --- AgentPhase ---------------------------------------------------------------------------


def test_drain_and_resize_exclude_each_other():
    """A drain during a resize replaces it; the drain's deadline is the one that counts."""
    p = AgentPhase().resize(deadline=50.0)
    assert p.resizing and not p.draining and p.deadline_passed(50.0) and not p.deadline_passed(49.9)
    p = p.drain(deadline=80.0)
    assert p.draining and not p.resizing and p.mode is Mode.DRAINING
    assert not p.deadline_passed(79.0) and p.deadline_passed(80.0)


def test_running_phase_has_no_deadline():
    """No drain or resize: no grace can run out."""
    assert not AgentPhase().deadline_passed(1e12)


def test_group_start_ends_a_resize_but_not_a_drain():
    """A new worker group ends a resize and clears failure/completion; a drain survives it."""
    p = AgentPhase().resize(10.0).failure_seen(3.0).done(4.0).group_started()
    assert p.mode is Mode.RUNNING and p.groups_started == 1
    assert p.failure_seen_at is None and p.done_at is None and p.fault_at == 3.0
    assert AgentPhase().drain(10.0).group_started().draining


def test_recovery_spans_restarts_until_workers_train():
    """fault_at keeps the first fault of a recovery across later faults, until recovered."""
    p = AgentPhase().failure_seen(5.0).fault(9.0)
    assert p.fault_at == 5.0 and p.failure_seen_at == 5.0
    assert p.recovered().fault_at is None and p.recovered().fault(12.0).fault_at == 12.0


# --- read-only facts ----------------------------------------------------------------------


class _Board:
    last_advance = 0.0
    first_advance = 0.0

    def max_step(self) -> int:
        return -1


class _Recording:
    """Stands in for the handler, recorder and control channel; logs every call that writes."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.round = 1
        self.node_id = "a"
        self.lease_lost = threading.Event()
        self.progress = _Board()

    # handler
    def view(self) -> RendezvousView:
        state = RoundState(1, "final", ["a", "b"], 1, 2)
        return RendezvousView(state, frozenset({"a", "b"}), failures={1: ["a", "b"]})

    def membership(self) -> Waiting:
        return Waiting()

    def probe_members(self) -> frozenset[str]:  # a read: probes run on threads of their own
        return frozenset()

    def report_failure(self, detail: str) -> None:
        self.writes.append("report_failure")

    def update_record(self, **changes: object) -> None:
        self.writes.append("update_record")

    # recorder
    def event(self, kind: str, message: str, **detail: object) -> None:
        self.writes.append(f"event:{kind}")

    def beat(self, step: int, local_world_size: int, *, activity: str = "",
             step_s: float = 0.0, busy_share: float = 0.0) -> None:
        self.writes.append("beat")

    # control
    def stopped_markers(self) -> list[str]:
        return []

    def workers_drainable(self) -> bool:
        return False

    def done_count(self) -> int:
        return 0


def _agent() -> tuple[ElasticdAgent, _Recording]:
    rec = _Recording()
    agent = ElasticdAgent.__new__(ElasticdAgent)  # no torch agent: only the loop's own state
    agent.settings = SupervisionSettings(attribution_window_s=3.0, beat_interval_s=0.0)
    agent.handler = agent.recorder = agent.control = rec  # type: ignore[assignment]
    agent.phase = AgentPhase(groups_started=1)
    agent.stop_signals = 0
    agent.metrics = agent.notifier = None
    agent._remaining_restarts = 3
    agent._done_checked_at = 0.0
    agent._group_started_at = 0.0
    agent._startup_failures, agent._past_startup = (), False
    agent._log = SimpleNamespace(warning=lambda *a, **k: None)  # type: ignore[assignment]
    agent.live = SimpleNamespace(facts=lambda now: None,  # type: ignore[assignment]  # live off
                                 starting=lambda **_: False, registered_after=lambda **_: None)
    spec = SimpleNamespace(local_world_size=1, max_restarts=3)
    agent._worker_group = SimpleNamespace(spec=spec, group_rank=0, group_world_size=2,  # type: ignore[assignment]
                                          state=WorkerState.FAILED)
    agent.ticks = TickWriter(agent.settings, rec, rec, rec, agent._worker_group,  # type: ignore[arg-type]
                             metrics=None, notifier=None, log=agent._log)
    return agent, rec


def _record_tick(agent: ElasticdAgent, facts, result, now: float) -> None:
    agent.phase = agent.ticks.record(facts, result, agent.phase, now)


def test_fact_gathering_writes_nothing_and_the_act_step_records_the_failure():
    """Gathering a tick's facts neither writes to etcd nor changes the phase; the act step does."""
    agent, rec = _agent()
    result = RunResult(state=WorkerState.FAILED)
    facts = agent._facts(result, 100.0)
    assert rec.writes == [] and agent.phase == AgentPhase(groups_started=1)
    assert facts.group_state is GroupState.FAILED and facts.attribution is Attribution.ROOT
    assert decide(facts).verdict is Verdict.RESTART_FAILURE
    _record_tick(agent, facts, result, 100.0)
    assert rec.writes[:2] == ["report_failure", "event:failure"] and "beat" in rec.writes
    assert agent.phase.failure_seen_at == 100.0 and agent.phase.fault_at == 100.0
    rec.writes.clear()
    _record_tick(agent, agent._facts(result, 101.0), result, 101.0)
    assert "report_failure" not in rec.writes  # a failure is reported once per group


def test_attribution_window_runs_from_the_recorded_first_sight():
    """The window passes attribution_window_s after the failure was first recorded, not first looked at."""
    agent, rec = _agent()
    rec.view = lambda: RendezvousView(RoundState(1, "final", ["a", "b"], 1, 2),  # type: ignore[method-assign]
                                      frozenset({"a", "b"}))
    result = RunResult(state=WorkerState.FAILED)
    assert not agent._facts(result, 100.0).attribution_window_passed
    _record_tick(agent, agent._facts(result, 100.0), result, 100.0)
    assert not agent._facts(result, 102.9).attribution_window_passed
    assert agent._facts(result, 103.0).attribution_window_passed


# --- the workers' environment -------------------------------------------------------------


def test_agent_worker_env_drops_secrets_even_from_workers_env():
    """Every worker gets the job, node and checkpoint URL, never an etcd credential."""
    env = agent_worker_env(job="j", node="n", agent_pid=7, control_env={"ELASTICD_CONTROL_DIR": "/c"},
                           user_env={"ELASTICD_ETCD_PASSWORD": "x", "FOO": "1"},
                           checkpoint_url="file:///ck")
    assert env[ENV_JOB] == "j" and env[ENV_CHECKPOINT_URL] == "file:///ck" and env["FOO"] == "1"
    assert "ELASTICD_ETCD_PASSWORD" not in env and env["PYTHONUNBUFFERED"] == "1"


# --- progress while the workers re-form -----------------------------------------------------


class _ProgressLog(_Recording):
    """The recorder's progress calls, with the world size each one published."""

    def __init__(self) -> None:
        super().__init__()
        del self.progress  # the base's board: here the recorder's progress method
        self.published: list[tuple[int, int]] = []  # (step, world size)

    def progress(self, step: int, epoch: int, samples: int, world_size: int, **_: object) -> None:
        self.published.append((step, world_size))


def test_no_progress_is_published_while_the_workers_re_form_in_place():
    """A join to 3 nodes: the group has the new round's size from the order on, while the
    workers still wait in the re-formation; the old round's last step, reported only now,
    is not published at the new size (the history would charge the pause to 3 workers).
    Once they re-formed, the next tick publishes at 3."""
    from elasticd.agent.policy import Facts, LiveFacts, LivePhase
    from elasticd.control.server import ProgressBoard

    rec = _ProgressLog()
    control = SimpleNamespace(progress=ProgressBoard())
    spec = SimpleNamespace(local_world_size=1)
    group = SimpleNamespace(spec=spec, group_rank=0, group_world_size=3, state=WorkerState.HEALTHY)
    ticks = TickWriter(SupervisionSettings(beat_interval_s=0.0), rec, control, rec, group,  # type: ignore[arg-type]
                       metrics=None, notifier=None,
                       log=SimpleNamespace(warning=lambda *a, **k: None))  # type: ignore[arg-type]
    control.progress.report(0, 41, 0, 41 * 8)  # the step the workers left the old round at
    result = RunResult(state=WorkerState.HEALTHY)
    reforming = Facts(GroupState.HEALTHY, live=LiveFacts(phase=LivePhase.REFORMING))
    ticks.record(reforming, result, AgentPhase(groups_started=1), 10.0)
    assert rec.published == []
    ticks.record(Facts(GroupState.HEALTHY, live=LiveFacts()), result, AgentPhase(groups_started=1), 12.0)
    assert rec.published == [(41, 3)]
