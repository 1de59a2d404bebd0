"""The live re-formation reports and the stopped report are typed, validated messages: the
live ones travel over the control socket into the agent's table, the stopped one is a file;
a worker waits for the agent's order on the socket instead of polling its file."""

from __future__ import annotations

import json
import threading

import pytest

from elasticd.control.messages import (
    AwaitOrder,
    LeaveReason,
    LiveRegistration,
    MessageError,
    OrderNotice,
    ParkedReport,
    Pong,
    ReformedReport,
    StoppedReport,
    parse_reply,
    parse_request,
    parse_stopped,
    serialise,
)
from elasticd.control.reform import OrderBoard, read_stopped, write_stopped
from elasticd.control.server import ControlChannel


@pytest.mark.parametrize("report", [
    LiveRegistration(local_rank=2, pid=1234, id=5),
    ParkedReport(local_rank=0, round=4, step=17, reason=LeaveReason.COLLECTIVE_FAILED, id=1),
    ParkedReport(local_rank=1, round=-1, step=-1, reason=LeaveReason.ORDERED),
    ReformedReport(local_rank=3, round=5, step=17, id=9),
    AwaitOrder(after_round=3, timeout_s=1.0, id=2),
])
def test_a_report_round_trips(report):
    """Every worker-to-agent live message survives serialise -> parse unchanged (enum reason included)."""
    assert parse_request(serialise(report)) == report


def test_the_stopped_report_and_the_order_notice_round_trip():
    """The stopped file's content and the order notice are typed messages too."""
    stopped = StoppedReport(rank=3, step=41, round=7, live_fallback="no new round within 30s")
    assert parse_stopped(serialise(stopped)) == stopped
    assert parse_reply(serialise(OrderNotice(round=8, id=4))) == OrderNotice(round=8, id=4)


@pytest.mark.parametrize("body, field", [
    ({"op": "parked", "local_rank": 0, "round": 1, "step": 2, "reason": "bored"}, "reason"),
    ({"op": "parked", "local_rank": 0, "round": 1, "step": True, "reason": "agreed_stop"}, "step"),
    ({"op": "reformed", "local_rank": -1, "round": 1, "step": 2}, "local_rank"),
    ({"op": "live", "local_rank": 0}, "pid"),
    ({"op": "await_order", "after_round": 1, "timeout_s": 3600}, "timeout_s"),
    ({"op": "bogus", "local_rank": 0}, "op"),
])
def test_an_invalid_report_is_refused_naming_the_field(body, field):
    """A report with a field of the wrong type, out of bounds or unknown is refused, and the
    error names what is wrong."""
    with pytest.raises(MessageError, match=field):
        parse_request(json.dumps(body).encode())


def test_the_agent_keeps_each_workers_latest_report_of_each_kind(tmp_path):
    """Reports sent on the socket are acknowledged and kept per kind and local rank; a
    re-formed worker is no longer parked; a rank beyond the node's is refused; every live
    report wakes the agent's tick."""
    channel = ControlChannel(directory=tmp_path, max_local_ranks=2)
    woken: list[int] = []
    channel.on_ping = lambda: woken.append(1)
    try:
        def send(msg) -> object:
            return channel.dispatch(serialise(msg))

        assert isinstance(send(LiveRegistration(local_rank=0, pid=7, id=1)), Pong)
        parked = ParkedReport(local_rank=1, round=3, step=9, reason=LeaveReason.AGREED_STOP, id=2)
        assert isinstance(send(parked), Pong)
        assert channel.reports.get(ParkedReport) == {1: parked}
        assert channel.reports.get(LiveRegistration) == {0: LiveRegistration(local_rank=0, pid=7, id=1)}
        send(ReformedReport(local_rank=1, round=4, step=9, id=3))
        assert channel.reports.get(ParkedReport) == {}
        assert set(channel.reports.get(ReformedReport)) == {1}
        assert send(LiveRegistration(local_rank=2, pid=8, id=4)).op == "error"
        assert set(channel.reports.get(LiveRegistration)) == {0} and len(woken) == 3
        channel.reports.clear(ReformedReport)
        assert channel.reports.get(ReformedReport) == {}
    finally:
        channel.close()


def test_only_valid_stopped_files_are_read(tmp_path):
    """A stopped report is read back typed; a torn one, an old untyped one, or one naming
    another rank than its file reads as absent."""
    write_stopped(tmp_path, StoppedReport(rank=0, step=9, round=3))
    (tmp_path / "stopped-1").write_text('{"op": "stopped", "rank": 1, "st')  # torn
    (tmp_path / "stopped-2").write_text('{"step": 7, "round": 3}')  # untyped
    (tmp_path / "stopped-3").write_bytes(serialise(StoppedReport(rank=5, step=9, round=3)))
    assert read_stopped(tmp_path) == {0: StoppedReport(rank=0, step=9, round=3)}


def test_a_wait_for_the_order_ends_when_it_is_published_not_at_its_bound():
    """A worker waiting for a newer order is answered as soon as the agent publishes one
    (no file polling); an order for its own round or an older one does not end the wait."""
    board = OrderBoard()
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(board.wait_newer(3, 30.0)))
    waiter.start()
    board.published(3)  # not newer: still waiting
    board.published(4)
    waiter.join(10.0)
    assert not waiter.is_alive() and got == [4], "the wait ran to its bound"
    assert board.wait_newer(4, 0.0) == 4  # nothing newer: answered at the (zero) bound
    board.reset()
    assert board.wait_newer(-1, 0.0) == -1
