"""A replica divergence is an event: the worker's report, the control channel, the agent's
event and metric, and the goodput ledger's ``integrity`` cause."""

from __future__ import annotations

import json

import pytest

from elasticd.agent.integrity import (
    DIVERGED_EVENT,
    QUARANTINE_WINDOW_S,
    DivergenceObserver,
    divergence_message,
    quarantine_s,
)
from elasticd.control import (
    ControlChannel,
    DivergenceReport,
    MessageError,
    parse_request,
    serialise,
)
from elasticd.history import History, Sample
from elasticd.keys import JobKeys
from elasticd.records import EVENT_KINDS, Event, ProbationRecord
from elasticd.status.goodput import CAUSES, compute
from elasticd.status.metrics import AgentMetrics


class FakeClient:
    """Records the quarantine's lease and transaction (the real client talks to etcd)."""

    def __init__(self) -> None:
        self.leases: list[int] = []
        self.puts: list[object] = []

    def grant_lease(self, ttl_s: int) -> int:
        self.leases.append(ttl_s)
        return 7

    def txn(self, compares: object, ops: list[object]) -> bool:
        self.puts += ops
        return True


class FakeSession:
    node_id = "nodeC"
    round = 3

    def fence(self) -> list[object]:
        return []


class FakeRecorder:
    """Collects the events the observer appends (the real one writes to etcd)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, object]]] = []
        self.session = FakeSession()
        self.client = FakeClient()
        self.keys = JobKeys("job")

    def event(self, kind: str, message: str, **detail: object) -> None:
        self.events.append((kind, message, detail))


def _line(**obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


@pytest.mark.timeout(10)
def test_a_divergence_report_round_trips_and_is_checked():
    """A report survives the wire; a source below -1 or a missing reason is refused."""
    msg = DivergenceReport(rank=3, step=41, source=0, reason="rank(s) [3] differ")
    assert parse_request(serialise(msg)) == msg
    with pytest.raises(MessageError, match="source"):
        parse_request(_line(op="diverged", rank=1, step=1, source=-2, reason="x"))
    with pytest.raises(MessageError, match="reason"):
        parse_request(_line(op="diverged", rank=1, step=1, source=0))


@pytest.mark.timeout(10)
def test_the_channel_hands_a_report_to_its_observer_and_never_answers():
    """A divergence is fire-and-forget: the observer gets it, no reply goes back, and a
    torn report is dropped unanswered."""
    seen: list[DivergenceReport] = []
    chan = ControlChannel(on_divergence=seen.append)
    try:
        msg = DivergenceReport(rank=1, step=9, source=-1, reason="no majority")
        assert chan.dispatch(serialise(msg)) is None
        assert seen == [msg]
        assert chan.dispatch(_line(op="diverged", rank="one")) is None
        assert len(seen) == 1
    finally:
        chan.close()


@pytest.mark.timeout(10)
def test_the_agent_records_an_event_naming_the_rank_and_counts_it():
    """The observer appends a ``diverged`` event (this node's) naming the rank, the step and
    the source, and counts elasticd_replica_divergences_total."""
    recorder, metrics = FakeRecorder(), AgentMetrics()
    observe = DivergenceObserver(recorder, metrics)  # type: ignore[arg-type]
    observe(DivergenceReport(rank=1, step=9, source=0, reason="r"))
    observe(DivergenceReport(rank=1, step=30, source=-1, reason="no majority"))
    assert DIVERGED_EVENT in EVENT_KINDS
    (k1, m1, d1), (k2, m2, d2) = recorder.events
    assert k1 == k2 == "diverged"
    assert m1 == "rank 1 diverged from its replicas at step 9: restored in memory from rank 0"
    assert d1 == {"rank": 1, "step": 9, "source": 0, "reason": "r"}
    assert "restarting from the newest checkpoint" in m2 and d2["source"] is None
    assert metrics.registry.get_sample_value("elasticd_replica_divergences_total") == 2


@pytest.mark.timeout(10)
def test_the_message_says_what_was_done():
    """With a majority the message names the source rank; without, the checkpoint."""
    assert "from rank 2" in divergence_message(DivergenceReport(0, 5, 2, ""))
    assert "no majority" in divergence_message(DivergenceReport(0, 5, -1, ""))


@pytest.mark.timeout(10)
def test_the_ledger_charges_a_divergence_to_integrity_before_the_restart_it_caused():
    """An interval holding a divergence and the failure it caused is charged to
    ``integrity``, not ``recovery``."""
    assert "integrity" in CAUSES
    samples = (*(Sample(i * 5.0, i * 10, 4) for i in range(3)), Sample(15.0, 20, 4),
               *(Sample(20.0 + i * 5.0, 30 + i * 10, 4) for i in range(3)))
    events = [Event(time=12.0, kind="diverged", node="n1", round=1, message="rank 1 diverged"),
              Event(time=12.5, kind="failure", node="n1", round=1, message="exit 1")]
    led = compute(History(5.0, samples), events)
    assert led.seconds["integrity"] == pytest.approx(5 * 4)  # t 10..15: no step at all
    assert led.seconds["recovery"] == 0


@pytest.mark.timeout(10)
def test_a_node_is_quarantined_only_when_it_diverges_again_within_the_window():
    """One divergence, two far apart, no base, or a job that cannot spare the node: no
    quarantine; two within the window: the base probation, doubled after a quarantine."""
    w = QUARANTINE_WINDOW_S
    assert quarantine_s([100.0], 100.0, base_s=60, earlier=0, can_leave=True) == 0
    assert quarantine_s([100.0, 100.0 + w + 1], 100.0 + w + 1, base_s=60, earlier=0,
                        can_leave=True) == 0
    assert quarantine_s([100.0, 200.0], 200.0, base_s=60, earlier=0, can_leave=True) == 60
    assert quarantine_s([100.0, 200.0], 200.0, base_s=60, earlier=1, can_leave=True) == 120
    assert quarantine_s([100.0, 200.0], 200.0, base_s=0, earlier=0, can_leave=True) == 0
    assert quarantine_s([100.0, 200.0], 200.0, base_s=60, earlier=0, can_leave=False) == 0


@pytest.mark.timeout(10)
def test_the_second_divergence_puts_the_node_on_probation_as_a_quarantine():
    """Two ranks named by one check count once; a second check naming a rank of this node
    writes rdzv/probation/<node> (cause "diverged") on a lease of the probation and records
    a "quarantined" event; the next quarantine needs two new divergences."""
    clock = iter([10.0, 11.0, 20.0, 21.0, 30.0])
    recorder = FakeRecorder()
    observe = DivergenceObserver(recorder, None, probation_base_s=45.0,  # type: ignore[arg-type]
                                 can_leave=lambda: True, clock=lambda: next(clock))
    observe(DivergenceReport(rank=4, step=9, source=0, reason=""))
    observe(DivergenceReport(rank=5, step=9, source=0, reason=""))
    assert recorder.client.puts == []
    observe(DivergenceReport(rank=4, step=19, source=0, reason=""))
    (put,) = recorder.client.puts
    assert put.key == recorder.keys.probation("nodeC") and put.lease == 7  # type: ignore[attr-defined]
    rec = ProbationRecord.from_json(put.value)  # type: ignore[attr-defined]
    assert rec.cause == "diverged" and rec.probation_s == 45.0 and rec.round == 3
    assert recorder.client.leases == [45]
    assert [k for k, _, _ in recorder.events] == ["diverged"] * 3 + ["quarantined"]
    assert observe.quarantines == 1
    observe(DivergenceReport(rank=4, step=29, source=0, reason=""))
    assert len(recorder.client.puts) == 1
