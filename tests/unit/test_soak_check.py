"""The soak's checker (tests/soak_check.py) on hand-made traces: it must catch a wrong
step, a missing step, a retrained step and a worker started too often."""

from __future__ import annotations

from soak_check import (
    final_attempts,
    retrained_steps,
    step_mismatches,
    unexplained_retrained,
    worker_starts,
)


def _row(step, rnd, rank, idx, glob, *, epoch=0, pid=1):
    return {"step": step, "round": rnd, "rank": rank, "pid": pid, "epoch": epoch, "idx": idx,
            "global": glob}


REF = [_row(0, None, 0, [1, 2, 3, 4], [1, 2, 3, 4]), _row(1, None, 0, [5, 6, 7, 8], [5, 6, 7, 8])]


def test_a_run_matching_the_reference_step_by_step_passes():
    """Two ranks whose shares make each step's global batch, as the reference: no finding."""
    rows = [_row(0, 1, 0, [1, 3], [1, 2, 3, 4]), _row(0, 1, 1, [2, 4], [1, 2, 3, 4], pid=2),
            _row(1, 1, 0, [5, 7], [5, 6, 7, 8]), _row(1, 1, 1, [6, 8], [5, 6, 7, 8], pid=2)]
    assert step_mismatches(rows, REF) == [] and retrained_steps(rows) == []


def test_only_the_final_attempt_counts_and_a_wrong_one_is_named():
    """A step rolled back and trained again is judged by its highest round; a final attempt
    with another global batch, a missing step and an extra step are each one finding."""
    rows = [_row(0, 1, 0, [9, 9, 9, 9], [9, 9, 9, 9]), _row(0, 2, 0, [1, 2, 3, 4], [1, 2, 3, 4])]
    assert [r["round"] for r in final_attempts(rows)[0]] == [2]
    assert step_mismatches(rows, REF) == ["step 1: never trained"]
    assert retrained_steps(rows) == [0]
    wrong = [*rows, _row(1, 2, 0, [5, 6, 7, 9], [5, 6, 7, 9]), _row(2, 2, 0, [1], [1])]
    found = step_mismatches(wrong, REF)
    assert found[0].startswith("step 1: rank 0 (pid 1, round 2) trained epoch 0 [5, 6, 7, 9]")
    assert found[1:] == ["step 1: the shares of ranks [0] are not its global batch",
                         "step 2: not in the reference"]


def test_shares_that_do_not_make_the_global_batch_are_found():
    """Every rank wrote its row but the shares overlap: a sample trained twice in the step."""
    rows = [_row(0, 1, 0, [1, 2], [1, 2, 3, 4]), _row(0, 1, 1, [2, 3], [1, 2, 3, 4], pid=2)]
    assert step_mismatches(rows, REF[:1]) == ["step 0: the shares of ranks [0, 1] are not its global batch"]


def test_worker_starts_beyond_the_nodes_and_freezes_are_unexplained():
    """One worker per node started and one more per freeze are explained; a third pid on
    two nodes with no freeze is one unexplained start."""
    rows = [_row(0, 1, 0, [], [], pid=p) for p in (10, 11, 12)]
    assert worker_starts(rows, nodes_started=2, nodes_frozen=0).unexplained == 1
    assert worker_starts(rows, nodes_started=2, nodes_frozen=1).unexplained == 0


def test_a_fallback_to_a_restart_explains_one_start_and_the_steps_since_the_checkpoint():
    """Soak seed 249928404: a peer frozen in the middle of a live re-formation makes a node
    fall back to a restart: one more worker start, and at most checkpoint_every steps
    retrained per round that fell back; without a fallback both stay findings."""
    rows = [_row(0, 1, 0, [], [], pid=p) for p in (10, 11, 12)]
    assert worker_starts(rows, nodes_started=2, nodes_frozen=0, fallbacks=1).unexplained == 0
    assert unexplained_retrained([114], fallback_rounds=1, checkpoint_every=5) == []
    assert unexplained_retrained([114], fallback_rounds=0, checkpoint_every=5) == [114]
    six = list(range(110, 116))
    assert unexplained_retrained(six, fallback_rounds=1, checkpoint_every=5) == six


def test_a_node_not_resurrected_after_an_etcd_outage_explains_one_start():
    """Soak seed 71211: etcd killed while a frozen node rejoined; another node's lease was
    gone when etcd came back and the round state had moved, so it rejoined as a new member
    (``lease_not_resurrected``) with new workers: explained, once per such rejoin."""
    rows = [_row(0, 1, 0, [], [], pid=p) for p in (10, 11, 12)]
    assert worker_starts(rows, nodes_started=2, nodes_frozen=0, rejoins=1).unexplained == 0
    assert worker_starts(rows, nodes_started=2, nodes_frozen=0, rejoins=0).unexplained == 1
