"""What ends the agent tick's wait early, what a first standby starts with, and the order of
a live re-formation's writes (issue 14: join and drain figures)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from elasticd.agent.early import early_standby_env
from elasticd.agent.policy import LivePhase
from elasticd.agent.reform import LiveReformation, LiveReformer
from elasticd.agent.supervision import AgentPhase
from elasticd.agent.wakeup import TickWaker
from elasticd.agent.warm import env_mismatch
from elasticd.control.messages import LiveRegistration
from elasticd.control.reform import ReformOrder, read_order
from elasticd.control.server import ControlChannel


@pytest.fixture
def waker():
    w = TickWaker()
    yield w
    w.close()


def test_a_wake_from_another_thread_ends_the_wait_at_once(waker):
    """The etcd watch thread and the control server wake the loop: no tick interval lost."""
    threading.Thread(target=waker.wake).start()
    start = time.monotonic()
    assert waker.wait(30.0) is True
    assert time.monotonic() - start < 10.0, "the wait ran to its bound"
    assert waker.wait(0.0) is False, "a wake-up is consumed once"


def test_a_child_exit_or_a_signal_ends_the_wait_once_installed(waker):
    """SIGCHLD (a worker exited) and any handled signal (SIGTERM's flag) write to the pipe,
    whichever thread the kernel picked; uninstall restores the previous disposition."""
    before = signal.getsignal(signal.SIGCHLD)
    waker.install()
    try:
        os.kill(os.getpid(), signal.SIGCHLD)
        assert waker.wait(30.0) is True
    finally:
        waker.uninstall()
    assert signal.getsignal(signal.SIGCHLD) == before
    assert signal.set_wakeup_fd(-1) == -1, "the wake-up fd was left installed"


def test_a_ping_calls_the_channels_hook(tmp_path):
    """A parked live worker pings; the agent's hook (its tick's wake-up) runs, the ping is answered."""
    channel = ControlChannel(base_dir=str(tmp_path))
    calls: list[int] = []
    channel.on_ping = lambda: calls.append(1)
    try:
        reply = channel.dispatch(b'{"op": "ping", "id": 7}\n')
    finally:
        channel.close()
    assert calls == [1] and reply is not None and reply.op == "pong"


def test_a_first_standby_differs_from_its_worker_only_in_what_the_agent_sets_later():
    """The run id, node, control socket... come after the standby started importing: not
    compared. The operator's [workers.env] is in the standby from the start, and still compared."""
    early = early_standby_env(agent_pid=42, control_dir=Path("/run/x"), user_env={"OMP_NUM_THREADS": "2"},
                              local_rank=0)
    assert early["OMP_NUM_THREADS"] == "2" and early["ELASTICD_CONTROL_DIR"] == "/run/x"
    worker = {**early, "ELASTICD_RUN_ID": "r1", "ELASTICD_RESUME": "auto", "ELASTICD_NODE": "n0",
              "ELASTICD_JOB": "j", "ELASTICD_CONTROL_SOCKET": "/run/x/control.sock",
              "ELASTICD_LIVE": "1", "ELASTICD_LOG_FORMAT": "json", "ELASTICD_ROUND": "3", "RANK": "2"}
    assert env_mismatch(early, worker) == []
    assert env_mismatch(early, {**worker, "OMP_NUM_THREADS": "8"}) == ["OMP_NUM_THREADS"]
    assert env_mismatch(early, {**worker, "ELASTICD_SOMETHING_ELSE": "1"}) == ["ELASTICD_SOMETHING_ELSE"]


class _Port:
    """A worker-group port whose rejoin forms round 4 (and says so in ``calls``)."""

    local_world_size = 1

    def __init__(self, handler: SimpleNamespace, calls: list[str], *, ranks: dict[int, int]) -> None:
        self.handler, self.calls, self.ranks = handler, calls, ranks

    def rejoin_keeping_workers(self) -> ReformOrder:
        self.calls.append("rendezvous")
        self.handler.round = 4
        self.handler.members = getattr(self.handler, "next_members", self.handler.members)
        return ReformOrder(round=4, world_size=1 + max(self.ranks.values()), master_addr="127.0.0.1",
                           master_port=29500, ranks=self.ranks)


def test_a_live_reformation_orders_its_workers_and_writes_no_record_itself(tmp_path):
    """The node record, the round event and metrics are etcd writes: the re-formation runs
    the round and publishes the order, and leaves them to the agent, which writes them after
    the order is out, so the workers re-form meanwhile instead of waiting for them."""
    calls: list[str] = []
    channel = ControlChannel(directory=tmp_path)
    reformer = LiveReformer(channel, enabled=True, timeout_s=30)
    handler = SimpleNamespace(round=3, node_id="n", keys=SimpleNamespace(job="j"), members=("n",))

    recorder = SimpleNamespace(event=lambda *a, **k: calls.append("event"))
    control = SimpleNamespace(clear_drain=lambda: calls.append("clear_drain"),
                              progress=SimpleNamespace(reset=lambda: calls.append("progress_reset")))
    live = LiveReformation(reformer, handler, control, recorder,  # type: ignore[arg-type]
                           _Port(handler, calls, ranks={0: 1}))
    order = live.reform("test", draining=False)
    assert calls == ["rendezvous", "clear_drain", "progress_reset"]  # no etcd write, no event
    assert read_order(tmp_path) == order and order.ranks == {0: 1}
    assert reformer.phase is LivePhase.REFORMING and reformer.reforming_round == 4
    assert channel.orders.wait_newer(3, 0.0) == 4  # workers waiting on the socket are told
    assert reformer.nobody_left  # round 4 holds every node of round 3
    channel.close()


def test_a_reformation_knows_whether_a_node_left_the_round(tmp_path):
    """``nobody_left``: the order's round holds every node of the one before (a local
    worker's death then is a worker failure); a round without one of them is a membership
    change; once the re-formation ends it is forgotten."""
    for before, after, want in [(("n", "m"), ("n", "m", "j"), True), (("n", "m"), ("n",), False)]:
        (tmp_path / f"{len(after)}").mkdir()
        channel = ControlChannel(directory=tmp_path / f"{len(after)}")
        reformer = LiveReformer(channel, enabled=True, timeout_s=30)
        handler = SimpleNamespace(round=3, node_id="n", keys=SimpleNamespace(job="j"),
                                  members=before, next_members=after)
        control = SimpleNamespace(clear_drain=lambda: None, progress=SimpleNamespace(reset=lambda: None))
        live = LiveReformation(reformer, handler, control, SimpleNamespace(),  # type: ignore[arg-type]
                               _Port(handler, [], ranks={0: 0}))
        live.reform("test", draining=False)
        assert reformer.nobody_left is want, (before, after)
        reformer.finish()
        assert not reformer.nobody_left
        channel.close()


def test_the_agent_writes_the_rounds_records_only_after_the_order_is_out(tmp_path):
    """REFORM_LIVE: the agent runs the round through its re-formation, and only then writes
    the node record ("re-forming" until the workers confirm: status must not report them in
    the new round yet); LIVE_DONE sets it back to training."""
    from elasticd.agent.elastic_agent import ElasticdAgent
    from elasticd.agent.policy import Decision, Verdict

    calls: list[str] = []
    channel = ControlChannel(directory=tmp_path)
    handler = SimpleNamespace(round=3, node_id="n", keys=SimpleNamespace(job="j"), members=("n",))

    recorder = SimpleNamespace(event=lambda kind, *a, **k: calls.append(f"event:{kind}"))
    agent = ElasticdAgent.__new__(ElasticdAgent)  # no torch agent: only the live steps
    agent.phase = AgentPhase(groups_started=1)
    agent._worker_group = SimpleNamespace()  # type: ignore[assignment]
    agent.live = LiveReformation(LiveReformer(channel, enabled=True, timeout_s=30), handler,  # type: ignore[arg-type]
                                 channel, recorder, _Port(handler, calls, ranks={0: 0}))
    agent._record_round = lambda group, *, state="training": calls.append(  # type: ignore[method-assign]
        f"{state} records (order for round {getattr(read_order(tmp_path), 'round', None)} out)")
    agent._set_state = lambda state, **kw: calls.append(f"state:{state}")  # type: ignore[method-assign]
    try:
        agent._act_live(Decision(Verdict.REFORM_LIVE, "test"), 10.0)
        assert calls == ["rendezvous", "re-forming records (order for round 4 out)"]
        assert agent.phase.fault_at is not None
        calls.clear()
        agent._act_live(Decision(Verdict.LIVE_DONE, "every worker re-formed"), 11.0)
        assert calls == ["event:reform", "state:training"]
        assert agent.live.reformer.phase is LivePhase.IDLE
    finally:
        channel.close()


@pytest.mark.parametrize("enabled, registered, any_step, age_s, starting", [
    (True, False, False, 5.0, True),     # workers still starting: a join waits for them
    (True, True, False, 5.0, False),     # registered: the live facts decide
    (True, False, True, 5.0, False),     # a step was trained: not starting
    (True, False, False, 31.0, False),   # past the re-formation bound: the restart path decides
    (False, False, False, 5.0, False),   # live re-formation off
])
def test_a_group_is_starting_for_live_reform_until_its_workers_register(
        tmp_path, enabled, registered, any_step, age_s, starting):
    channel = ControlChannel(directory=tmp_path)
    handler = SimpleNamespace(round=3, node_id="n", keys=SimpleNamespace(job="j"), members=("n",))
    live = LiveReformation(LiveReformer(channel, enabled=enabled, timeout_s=30), handler,  # type: ignore[arg-type]
                           SimpleNamespace(), SimpleNamespace(), _Port(handler, [], ranks={0: 0}))
    if registered:
        channel.reports.put(LiveRegistration(local_rank=0, pid=os.getpid()))
    assert live.starting(now=100.0 + age_s, group_started_at=100.0, any_step=any_step) is starting
    channel.close()
