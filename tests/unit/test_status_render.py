"""Unit tests of the status screen: 80-column layout, colour rules, value formatting."""

from __future__ import annotations

import io
import re
from dataclasses import replace

import pytest

from elasticd.records import CheckpointPointer, Event, NodeRecord, Progress, RoundState
from elasticd.status.model import derive_status
from elasticd.status.render import (
    Col,
    fit_widths,
    format_ranks,
    format_time,
    make_console,
    print_screen,
    render_job,
    render_job_list,
)
from elasticd.status.snapshot import JobSnapshot, SeqEvent

NOW = 1_750_000_000.0
COLOR_SGR = re.compile(r"\x1b\[(?:[0-9;]*;)?(?:3[0-8]|9[0-7])(?:;[0-9;]*)?m")


def long_job(n_nodes: int = 6, lost: int = 1) -> JobSnapshot:
    members = [f"ip-10-200-{i}-{i}.eu-west-1.compute.internal" for i in range(n_nodes)]
    nodes = tuple(
        NodeRecord(node=m, host=m, pid=4242, version="0.1.0.dev123+gdeadbeef",
                   started_at=NOW - 3600, state="training", round=17,
                   ranks=list(range(8 * i, 8 * i + 8)), restarts=i, heartbeat_at=NOW - 2,
                   local_world_size=8)
        for i, m in enumerate(members[: n_nodes - lost]))
    events = tuple(
        SeqEvent(i, Event(time=NOW - 600 + i, kind=k, node=members[i % n_nodes], round=16,
                          message="worker rank 13 exited because the NCCL watchdog caught a "
                                  "collective operation timeout after 1800000 milliseconds",
                          detail={"exit_code": 134} if k == "failure" else {}))
        for i, k in enumerate(["join", "failure", "lease_lost", "restart", "notice", "drain",
                               "leave", "lost", "round", "hang"]))
    return JobSnapshot(
        job="a-job-name-that-is-long-enough-to-hurt-0123456789", revision=99,
        round_state=RoundState(round=17, phase="final", members=members, min_nodes=2,
                               max_nodes=n_nodes + 2, opened_at=NOW - 70, completed_at=NOW - 60),
        nodes=nodes, events=events,
        progress=Progress(round=17, step=1_234_567, epoch=12, samples_per_s=123456.7,
                          world_size=8 * n_nodes, updated_at=NOW - 1),
        checkpoint=CheckpointPointer(
            step=1_234_000, round=17, committed_at=NOW - 300,
            manifest_url="s3://user:hunter2@bucket/very/long/prefix/run-2025-06-15/"
                         "step-1234000/manifest.json?X-Amz-Signature=abcdef"),
    )


def render_text(renderable, width: int = 80) -> str:
    buf = io.StringIO()
    make_console(buf, width=width).print(renderable)
    return buf.getvalue()


@pytest.mark.parametrize("width", [80, 60, 120])
def test_job_screen_fits_width_and_keeps_one_line_per_row(width):
    """At 80 (and 60, 120) columns no line overflows and each node/event stays on one line."""
    snap = long_job()
    out = render_text(render_job(derive_status(snap, NOW)), width)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width
    for i in range(5):  # every live node is exactly one row, found by its unique prefix
        assert sum(f"ip-10-200-{i}-" in line for line in lines[9:]) >= 1
    node_rows = [ln for ln in lines if ln.startswith("ip-10-200-")]
    assert len(node_rows) == 6  # 5 live + 1 lost, no continuation lines
    event_rows = [ln for ln in lines if re.match(r"^\d\d:\d\d:\d\d ", ln)]
    assert len(event_rows) == 10
    assert "lost" in next(ln for ln in node_rows if ln.startswith("ip-10-200-5-"))


def test_screen_at_80_shows_the_operator_questions():
    """The 80-column screen answers state, size, speed, checkpoint, failures and exit cause."""
    out = render_text(render_job(derive_status(long_job(), NOW)))
    assert "RE-FORMING" in out and "1 member(s) of round 17 lost" in out
    assert "6 nodes (min 2, max 8), world size 48" in out
    assert "step 1,234,567" in out and "123,456.7 samples/s" in out
    assert "step 1,234,000 · 5m00s ago · round 17" in out
    assert "exit 134" in out and "lease_lost" in out
    assert "hunter2" not in out and "abcdef" not in out  # URL secrets redacted


def test_nodes_beyond_max_rows_keep_unhealthy_ones():
    """With more nodes than --max-rows, the lost node is kept and the cut is announced."""
    out = render_text(render_job(derive_status(long_job(n_nodes=30, lost=1), NOW), max_rows=5))
    assert "ip-10-200-29-29" in out  # the lost one, last in rank order
    assert "... and 25 more healthy nodes" in out


def test_job_list_fits_80_columns():
    """The job list keeps one line per job at 80 columns."""
    statuses = [derive_status(long_job(), NOW), derive_status(long_job(lost=0), NOW)]
    out = render_text(render_job_list(statuses, NOW))
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80
    assert len([ln for ln in lines if ln.startswith("a-job-name-")]) == 2
    assert "re-forming" in out and "degraded" in out


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_on_a_tty_and_not_with_no_color(monkeypatch):
    """Colour only on a terminal, and never when NO_COLOR is set."""
    screen = render_job(derive_status(long_job(), NOW))
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    tty = _Tty()
    make_console(tty, width=80).print(screen)
    assert COLOR_SGR.search(tty.getvalue())
    monkeypatch.setenv("NO_COLOR", "1")
    tty = _Tty()
    make_console(tty, width=80).print(screen)
    assert not COLOR_SGR.search(tty.getvalue())
    monkeypatch.delenv("NO_COLOR")
    assert "\x1b[" not in render_text(screen)  # not a terminal: plain text


def test_fit_widths_shrinks_then_drops_in_priority_order():
    """Columns give up width by 'shrink' order and are dropped by 'drop' order."""
    cols = [Col("a"), Col("b", min_width=4, shrink=1), Col("c", min_width=2, shrink=2, drop=1)]
    assert fit_widths(cols, [5, 10, 10], 40) == [5, 10, 10]
    assert fit_widths(cols, [5, 10, 10], 25) == [5, 10, 4]  # c shrinks first
    assert fit_widths(cols, [5, 10, 10], 18) == [5, 5, 2]
    assert fit_widths(cols, [5, 10, 10], 12) == [5, 4, None]  # c dropped, b at its minimum


@pytest.mark.parametrize("ranks,text", [([], "-"), ([3], "3"), ([0, 1, 2, 3], "0-3"),
                                        ([8, 0, 1, 5, 6], "0-1,5-6,8")])
def test_format_ranks(ranks, text):
    """Ranks print as compact ranges."""
    assert format_ranks(ranks) == text


def test_format_time_is_utc_with_date_when_old():
    """Event times are UTC; older than a day they carry the date."""
    assert format_time(1_750_000_000.0, 1_750_000_010.0) == "15:06:40"
    assert format_time(1_750_000_000.0, 1_750_200_000.0) == "06-15 15:06"


def test_checkpoint_url_is_printed_whole_on_one_line():
    """The checkpoint URL is never folded mid-path on a narrow screen (it is copied), and
    its credentials are still redacted."""
    buf = io.StringIO()
    print_screen(make_console(buf, width=60), render_job(derive_status(long_job(), NOW)))
    url = [ln.strip() for ln in buf.getvalue().splitlines() if "manifest.json" in ln]
    assert url == ["s3://***@bucket/very/long/prefix/run-2025-06-15/step-1234000/manifest.json"
                   "?X-Amz-Signature=<redacted>"]


def test_output_that_is_not_a_terminal_is_not_cut(monkeypatch):
    """Piped output (no COLUMNS) keeps whole event messages instead of rich's 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    snap = long_job()
    message = "worker 3 exited: " + "a long cause that goes on " * 6 + "END"
    snap = replace(snap, events=(SeqEvent(99, Event(time=NOW - 1, kind="failure", node="n",
                                                    round=17, message=message)),))
    buf = io.StringIO()
    print_screen(make_console(buf), render_job(derive_status(snap, NOW)))
    assert message in buf.getvalue()
