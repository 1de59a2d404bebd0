"""Progress publishing while etcd is down: one warning an outage, one try an interval."""

from __future__ import annotations

from types import SimpleNamespace

import structlog.testing

from elasticd.agent.recorder import PROGRESS_INTERVAL_S, JobRecorder
from elasticd.errors import EtcdUnavailableError
from elasticd.keys import JobKeys


class DownClient:
    """An etcd client whose every write fails as if etcd were down, counting the calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.down = True

    def txn(self, compares, success, failure=()):
        self.calls += 1
        if self.down:
            raise EtcdUnavailableError("etcd at 127.0.0.1:1 unreachable")
        return True

    def get(self, key):
        return None


def test_an_outage_costs_one_warning_and_one_call_per_interval(monkeypatch):
    """Every step reports progress; while etcd is down the agent tries once an interval
    and warns once, and says so when progress is published again."""
    client = DownClient()
    session = SimpleNamespace(client=client, keys=JobKeys("j"), fence=lambda: [], round=1)
    rec = JobRecorder(session)  # type: ignore[arg-type]
    clock = [1000.0]
    monkeypatch.setattr("elasticd.agent.recorder.time.time", lambda: clock[0])
    with structlog.testing.capture_logs() as logs:
        for step in range(1, 101):  # 100 steps of 0.1 s: 10 s of outage
            clock[0] += 0.1
            rec.progress(step, 0, step * 8, 2)
        client.down = False
        clock[0] += PROGRESS_INTERVAL_S
        rec.progress(101, 0, 808, 2)
    assert client.calls <= 10 / PROGRESS_INTERVAL_S + 2
    events = [e["event"] for e in logs]
    assert events.count("progress_not_published") == 1
    assert "progress_published_again" in events


def test_every_rollback_is_an_event_with_its_steps(monkeypatch):
    """Progress that goes back (a peer-RAM replica 12 steps behind) is recorded as one
    `rollback` event with the steps, even between two published samples."""
    from elasticd.records import Event

    client = DownClient()
    client.down = False
    puts: list = []
    client.txn = lambda compares, success, failure=(): puts.extend(success) or True  # type: ignore[method-assign]
    session = SimpleNamespace(client=client, keys=JobKeys("j"), fence=lambda: [], round=1,
                              node_id="n0")
    rec = JobRecorder(session)  # type: ignore[arg-type]
    clock = [1000.0]
    monkeypatch.setattr("elasticd.agent.recorder.time.time", lambda: clock[0])
    for step in [*range(1, 101), *range(88, 120)]:
        clock[0] += 0.01  # all inside one progress interval but the first
        rec.progress(step, 0, step * 8, 2)
    events = [Event.from_json(p.value) for p in puts if "/events/" in p.key]
    assert [e.kind for e in events] == ["rollback"]
    assert events[0].detail == {"steps": 12, "from_step": 100}
