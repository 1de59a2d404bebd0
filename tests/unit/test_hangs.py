"""Which node hangs the job (pure policy over the members' reported progress)."""

from __future__ import annotations

import os

from elasticd.rendezvous.hangs import (
    STALL_STEPS,
    HangWatch,
    NodeProgress,
    ProcActivity,
    WorkerActivity,
    classify_activity,
    find_hung,
    stall_threshold,
)

W, S, B = WorkerActivity.WAITING, WorkerActivity.STOPPED, WorkerActivity.BUSY


def _p(step: int, at: float, activity: WorkerActivity = WorkerActivity.UNKNOWN) -> NodeProgress:
    return NodeProgress(step, at, activity)


def test_a_progressing_job_ejects_nobody() -> None:
    """Any member's recent step means the job trains: no verdict, however old the others."""
    v = find_hung({"a": _p(10, 99.0), "b": _p(9, 90.0), "c": _p(10, 99.0)}, now=100.0, stall_s=5)
    assert v.node is None and "progress" in v.reason


def test_the_one_node_behind_a_stalled_job_is_named() -> None:
    """Stalled past stall_s and one node a step behind: it is the culprit."""
    v = find_hung({"a": _p(10, 90.0), "b": _p(9, 89.0), "c": _p(10, 90.0)}, now=100.0, stall_s=5)
    assert v.node == "b" and "behind at step 9" in v.reason


def test_a_stall_counts_from_the_latest_etcd_trouble_the_coordinator_saw() -> None:
    """Soak seed 72005: progress reaches the coordinator through etcd, so an etcd freeze
    looks like a stall. Read the moment etcd is back (its own node's report not yet written
    again), the job seemed stalled 5 s with that node behind; counted from the end of the
    trouble it has not stalled, and nobody is named until it truly does."""
    progress = {"n4": _p(87, 95.0), "n5": _p(85, 94.0)}
    assert find_hung(progress, now=100.0, stall_s=5).node == "n5"  # before the fix
    v = find_hung(progress, now=100.0, stall_s=5, blind_until=99.9)
    assert v.node is None and "progress" in v.reason
    assert find_hung(progress, now=105.0, stall_s=5, blind_until=99.9).node == "n5"


def test_equal_steps_name_the_stopped_or_busy_node_only_if_the_others_wait() -> None:
    """Same step everywhere: the node whose workers are stopped (or busy) while every
    other waits is named; unknown activity or two odd nodes name nobody."""
    base = {"a": _p(10, 90.0, W), "c": _p(10, 90.0, W)}
    assert find_hung({**base, "b": _p(10, 90.0, S)}, now=100.0, stall_s=5).node == "b"
    assert find_hung({**base, "b": _p(10, 90.0, B)}, now=100.0, stall_s=5).node == "b"
    assert find_hung({"a": _p(10, 90.0), "b": _p(10, 90.0, S), "c": _p(10, 90.0, W)},
                     now=100.0, stall_s=5).node is None
    assert find_hung({"a": _p(10, 90.0, S), "b": _p(10, 90.0, B), "c": _p(10, 90.0, W)},
                     now=100.0, stall_s=5).node is None


def test_a_verdict_says_how_long_the_job_stalled_once_past_the_threshold() -> None:
    """``stalled_s`` is the stall the verdict judged (the coordinator's "job_stalled" line),
    0 while the job makes progress, whether or not a node is named."""
    assert find_hung({"a": _p(10, 99.0), "b": _p(10, 99.0)}, now=100.0, stall_s=5).stalled_s == 0
    named = find_hung({"a": _p(10, 90.0), "b": _p(9, 89.0)}, now=100.0, stall_s=5)
    nobody = find_hung({"a": _p(10, 92.0, W), "b": _p(10, 92.0, W)}, now=100.0, stall_s=5)
    assert (named.node, named.stalled_s) == ("b", 10.0)
    assert nobody.node is None and nobody.stalled_s == 8.0 and "8.0s" in nobody.reason


def test_never_below_min_nodes_and_never_alone() -> None:
    """An ejection that would leave fewer than min_nodes, or a one-node job: nobody."""
    hung = {"a": _p(10, 90.0), "b": _p(9, 89.0)}
    assert find_hung(hung, now=100.0, stall_s=5, min_nodes=2).node is None
    assert find_hung(hung, now=100.0, stall_s=5, min_nodes=1).node == "b"
    assert find_hung({"a": _p(10, 0.0)}, now=100.0, stall_s=5).node is None


def test_several_nodes_behind_name_nobody() -> None:
    """Two nodes behind: no single culprit, the hang timeout decides."""
    v = find_hung({"a": _p(10, 90.0), "b": _p(9, 89.0), "c": _p(8, 88.0)}, now=100.0, stall_s=5)
    assert v.node is None and "b,c" in v.reason


IO = WorkerActivity.IO


def test_a_node_in_io_stops_any_ejection() -> None:
    """A legitimately slow job (a synchronous save: ``D`` in /proc) ejects nobody, even a
    node that is behind or stopped beside it."""
    v = find_hung({"a": _p(10, 90.0, IO), "b": _p(9, 89.0, S), "c": _p(10, 90.0, W)},
                  now=100.0, stall_s=5)
    assert v.node is None and "I/O" in v.reason


def test_everyone_waiting_or_everyone_busy_names_nobody() -> None:
    """The whole job slow together (a data stall: all wait; a long step: all compute)."""
    for act in (W, B):
        v = find_hung({n: _p(10, 0.0, act) for n in "abc"}, now=100.0, stall_s=5)
        assert v.node is None, act


def test_a_busy_node_is_named_only_after_the_longer_busy_stall() -> None:
    """One rank's legitimate work (an evaluation) looks like a GIL-bound loop for a while:
    a busy node is named after ``busy_stall_s``; a stopped one after ``stall_s``."""
    base = {"a": _p(10, 90.0, W), "c": _p(10, 90.0, W)}
    early = find_hung({**base, "b": _p(10, 90.0, B)}, now=100.0, stall_s=5, busy_stall_s=20)
    assert early.node is None and "busy" in early.reason
    assert find_hung({**base, "b": _p(10, 90.0, B)}, now=111.0, stall_s=5, busy_stall_s=20).node == "b"
    assert find_hung({**base, "b": _p(10, 90.0, S)}, now=100.0, stall_s=5, busy_stall_s=20).node == "b"
    behind_busy = {"a": _p(10, 90.0, W), "b": _p(9, 89.0, B), "c": _p(10, 90.0, W)}
    assert find_hung(behind_busy, now=100.0, stall_s=5, busy_stall_s=20).node is None


def test_stall_threshold_scales_with_the_step_time() -> None:
    """A few step times, never below the floor: 10 s steps are not a hang after 2 s."""
    assert stall_threshold(2.0, []) == 2.0
    assert stall_threshold(2.0, [0.1, 0.12, 0.0]) == 2.0
    assert stall_threshold(2.0, [10.0, 9.0, 11.0]) == STALL_STEPS * 10.0


def test_activity_from_proc_states_and_cpu() -> None:
    """Stopped beats I/O beats busy; an idle worker waits; no worker: unknown."""
    assert classify_activity(["S", "T"], 0.0, 1.0) is S
    assert classify_activity(["t"], 0.0, 1.0) is S
    assert classify_activity(["D", "R"], 1.0, 1.0) is IO
    assert classify_activity(["R"], 0.9, 1.0) is B
    assert classify_activity(["S"], 0.05, 1.0) is W
    assert classify_activity([], 0.0, 1.0) is WorkerActivity.UNKNOWN
    assert classify_activity(["S"], 0.0, 0.0) is WorkerActivity.UNKNOWN


def test_proc_activity_reads_a_fake_proc(tmp_path) -> None:
    """The thin reader parses /proc/<pid>/stat (a name with spaces and parentheses) and
    judges CPU use between two samples; a vanished pid is left out."""
    ticks = os.sysconf("SC_CLK_TCK")

    def write(state: str, cpu_ticks: int) -> None:
        (tmp_path / "42").mkdir(exist_ok=True)
        fields = [state] + ["0"] * 10 + [str(cpu_ticks), "0"] + ["0"] * 30
        (tmp_path / "42" / "stat").write_text(f"42 (python (x) y) {' '.join(fields)}\n")

    pa = ProcActivity(str(tmp_path))
    write("S", 0)
    assert pa.sample([42, 43], 0.0) is WorkerActivity.UNKNOWN  # no interval yet
    write("R", ticks)  # one CPU second in one second
    assert pa.sample([42], 1.0) is B
    write("S", ticks)
    assert pa.sample([42], 2.0) is W
    write("T", ticks)
    assert pa.sample([42], 3.0) is S


def test_hang_watch_uses_its_own_clock_and_arms_once_everyone_stepped() -> None:
    """Advances are timed when the coordinator sees them; beats of another round are
    ignored; nothing is named before every member reported a step in the round."""
    hw = HangWatch()
    members = ["a", "b", "c"]
    hw.observe(3, members, {"a": (3, 5, W, 0.1), "b": (3, 5, W, 0.1), "c": (2, 9, W, 0.1)}, 10.0)
    assert not hw.armed(3, members)
    assert hw.verdict(3, members, now=100.0, floor_s=2.0, min_nodes=1).node is None
    hw.observe(3, members, {"a": (3, 6, W, 0.1), "b": (3, 6, W, 0.1), "c": (3, 5, S, 0.1)}, 11.0)
    assert hw.armed(3, members)
    assert hw.verdict(3, members, now=12.0, floor_s=2.0, min_nodes=1).node is None  # 1 s
    # The same facts read again later do not move "advanced_at".
    hw.observe(3, members, {"a": (3, 6, W, 0.1), "b": (3, 6, W, 0.1), "c": (3, 5, S, 0.1)}, 13.5)
    v = hw.verdict(3, members, now=13.5, floor_s=2.0, min_nodes=1)
    assert v.node == "c" and "behind" in v.reason
    # Asked about round 4 before it was observed: the round-3 facts judge nobody.
    assert not hw.armed(4, members[:2])
    assert hw.verdict(4, members[:2], now=13.5, floor_s=2.0, min_nodes=1).node is None
    hw.observe(4, members, {}, 14.0)  # a new round forgets the old one
    assert not hw.armed(4, members)


def test_step_clock_measures_seconds_per_step_over_its_window() -> None:
    """The node's recent step time (the beat's ``step_s``): from step changes only; a new
    group resuming at an older step starts over."""
    from elasticd.agent.ticks import StepClock

    sc = StepClock(window_s=10.0)
    assert sc.step_s() == 0.0
    for i in range(5):
        sc.observe(i, i * 0.5)
        sc.observe(i, i * 0.5 + 0.1)  # the same step seen again: no new mark
    assert sc.step_s() == 0.5
    sc.observe(2, 3.0)
    assert sc.step_s() == 0.0
