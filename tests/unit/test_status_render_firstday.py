"""What the status screen says about stale members, stopped jobs and a round's cause."""

from __future__ import annotations

import io
from dataclasses import replace

from elasticd.records import NodeRecord, RoundState
from elasticd.status.model import derive_status
from elasticd.status.render import make_console, render_job, render_job_list
from elasticd.status.snapshot import JobSnapshot

NOW = 1_750_000_000.0


def _node(name: str, *, state: str = "training", round_: int = 5, rank0: int = 0) -> NodeRecord:
    return NodeRecord(node=name, host=name, pid=100, version="0.1.0", started_at=NOW - 600,
                      state=state, round=round_, ranks=[rank0], heartbeat_at=NOW - 1,
                      local_world_size=1)


def _snap(members=("a", "b"), live=None, **state) -> JobSnapshot:
    live = [_node(m, rank0=i) for i, m in enumerate(members)] if live is None else live
    rs = RoundState(round=5, phase="final", members=list(members), min_nodes=1, max_nodes=2,
                    opened_at=NOW - 100, completed_at=NOW - 90, **state)
    return JobSnapshot(job="demo", revision=1, round_state=rs, nodes=tuple(live))


def _text(snap: JobSnapshot, job_list: bool = False) -> str:
    buf = io.StringIO()
    st = derive_status(snap, NOW)
    make_console(buf, width=120).print(render_job_list([st], NOW) if job_list else render_job(st))
    return buf.getvalue()


def test_a_star_after_a_state_is_explained_by_a_legend_line():
    """A node that trains outside the current round is marked * and the mark is explained."""
    text = _text(_snap(members=("a",), live=[_node("a"), _node("b", round_=4, rank0=1)]))
    assert "training*" in text
    assert "* trains, but is not a member of the current round" in text
    assert "* trains" not in _text(_snap())


def test_a_stopped_job_shows_no_size_or_world_size():
    """After a stop or finish the old round's sizes are shown as -, in the screen and the list."""
    stopped = _snap(live=[_node("a", state="stopped"), _node("b", state="stopped", rank0=1)])
    text = _text(stopped)
    size = next(line for line in text.splitlines() if line.startswith("size"))
    assert "- nodes" in size and "world size -" in size and "2 nodes" not in size
    row = next(line for line in _text(stopped, job_list=True).splitlines() if "demo" in line)
    assert "2/2" not in row
    assert "2 nodes" in _text(_snap())


def test_a_node_that_left_and_is_back_in_the_round_is_not_reported_gone():
    """'opened for member left: b' in a final round that b is a member of says b is back."""
    back = _text(_snap(cause="member_left", changed=["b"]))
    assert "opened for member left: b (back in this round)" in back
    gone = _text(_snap(members=("a",), cause="member_left", changed=["b"]))
    assert "opened for member left: b" in gone and "back in this round" not in gone


def test_a_round_still_open_keeps_the_plain_cause():
    """While the round is open the node is not back yet: the cause is shown as written."""
    snap = _snap(cause="member_lost", changed=["b"])
    snap = replace(snap, round_state=replace(snap.round_state, phase="open"))
    assert "opened for member lost: b" in _text(snap) and "back in" not in _text(snap)
