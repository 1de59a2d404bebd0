"""Which node hangs the job (pure policy over the members' reported progress)."""

from __future__ import annotations

from elasticd.agent.hangs import NodeProgress, WorkerActivity, find_hung

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
