"""The live re-formation reports (live-, parked-, reformed-) are typed, validated messages."""

from __future__ import annotations

import json

import pytest

from elasticd.control.messages import (
    LeaveReason,
    LiveRegistration,
    MessageError,
    ParkedReport,
    ReformedReport,
    parse_live_report,
    serialise,
)
from elasticd.control.reform import (
    clear_report,
    clear_reports,
    live_workers,
    parked,
    reformed,
    write_report,
)


@pytest.mark.parametrize("report", [
    LiveRegistration(local_rank=2, pid=1234),
    ParkedReport(local_rank=0, round=4, step=17, reason=LeaveReason.COLLECTIVE_FAILED),
    ParkedReport(local_rank=1, round=-1, step=-1, reason=LeaveReason.ORDERED),
    ReformedReport(local_rank=3, round=5, step=17),
])
def test_a_report_round_trips(report):
    """Every report kind survives serialise -> parse unchanged (enum reason included)."""
    assert parse_live_report(serialise(report)) == report


@pytest.mark.parametrize("body, field", [
    ({"op": "parked", "local_rank": 0, "round": 1, "step": 2, "reason": "bored"}, "reason"),
    ({"op": "parked", "local_rank": 0, "round": 1, "step": True, "reason": "agreed_stop"}, "step"),
    ({"op": "reformed", "local_rank": -1, "round": 1, "step": 2}, "local_rank"),
    ({"op": "live", "local_rank": 0}, "pid"),
    ({"op": "commit", "local_rank": 0}, "op"),
])
def test_an_invalid_report_is_refused_naming_the_field(body, field):
    """A report with a field of the wrong type, out of bounds or unknown is refused, and the
    error names what is wrong."""
    with pytest.raises(MessageError, match=field):
        parse_live_report(json.dumps(body).encode())


def test_the_agent_reads_only_valid_reports_of_the_kind_asked(tmp_path):
    """A torn file, a file of another kind, or one whose local rank differs from its name
    reads as absent; the rest are typed records keyed by local rank."""
    write_report(tmp_path, ParkedReport(local_rank=0, round=3, step=9, reason=LeaveReason.AGREED_STOP))
    write_report(tmp_path, ReformedReport(local_rank=1, round=4, step=9))
    write_report(tmp_path, LiveRegistration(local_rank=0, pid=7))
    (tmp_path / "parked-1").write_text('{"op": "parked", "local_rank": 1, "ro')  # torn
    (tmp_path / "parked-2").write_bytes(serialise(ReformedReport(local_rank=2, round=4, step=9)))
    (tmp_path / "parked-3").write_bytes(
        serialise(ParkedReport(local_rank=5, round=3, step=9, reason=LeaveReason.ORDERED)))
    assert parked(tmp_path) == {0: ParkedReport(local_rank=0, round=3, step=9,
                                                reason=LeaveReason.AGREED_STOP)}
    assert reformed(tmp_path) == {1: ReformedReport(local_rank=1, round=4, step=9)}
    assert live_workers(tmp_path) == {0: LiveRegistration(local_rank=0, pid=7)}
    clear_report(tmp_path, ParkedReport, 0)
    clear_reports(tmp_path, ReformedReport)
    assert parked(tmp_path) == {} and reformed(tmp_path) == {} and live_workers(tmp_path)
