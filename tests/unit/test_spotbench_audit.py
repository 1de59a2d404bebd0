"""The live replay's external audit (benchmarks/spotbench/audit.py) and window choice."""

from __future__ import annotations

import pytest

from benchmarks.spotbench.audit import (
    attempts,
    audit,
    available_node_s,
    batch_hash,
    exactly_once,
    observed_costs,
    stretches,
)
from benchmarks.spotbench.live import busiest_window, window_counts
from benchmarks.spotbench.traces import Trace

pytestmark = pytest.mark.timeout(30)


def _rows(step, t, world, rnd=None, batch=None, shares=None):
    batch = batch if batch is not None else list(range(4 * step, 4 * step + 4))
    shares = shares if shares is not None else [batch[r::world] for r in range(world)]
    return [{"step": step, "epoch": 0, "rank": r, "round": rnd, "world": world, "pid": 100 + r,
             "time": t + 0.001 * r, "idx": shares[r], "global": batch} for r in range(world)]


def _ref(steps):
    return [{"step": s, "epoch": 0, "rank": 0, "round": None, "world": 1, "pid": 1, "time": 0.0,
             "idx": list(range(4 * s, 4 * s + 4)), "global": list(range(4 * s, 4 * s + 4))}
            for s in range(steps)]


def test_attempts_by_round_and_by_time():
    rows = [*_rows(5, 10.0, 2, rnd=1), *_rows(5, 10.2, 2, rnd=2)]
    assert [len(a) for a in attempts(rows)[5]] == [2, 2]  # rounds differ: two attempts 0.2 s apart
    rows = [*_rows(5, 10.0, 2), *_rows(5, 14.0, 2)]  # no round (torchrun): a restart apart
    assert [len(a) for a in attempts(rows)[5]] == [2, 2]
    rows = _rows(5, 10.0, 2)
    assert [len(a) for a in attempts(rows)[5]] == [2]


def test_exactly_once_passes_a_clean_run_with_a_retrained_step():
    rows = [*_rows(0, 1.0, 2), *_rows(1, 1.1, 2), *_rows(1, 5.0, 2), *_rows(2, 5.1, 2)]
    v = exactly_once(rows, _ref(3))
    assert v.ok and v.steps == 3 and v.retrained_steps == 1


def test_exactly_once_names_a_skipped_a_duplicated_and_a_wrong_step():
    dup = _rows(1, 1.1, 2, shares=[[4, 5], [4, 5]])
    wrong = _rows(2, 1.2, 2, batch=[9, 9, 9, 8])
    rows = [*_rows(0, 1.0, 2), *dup, *wrong, *_rows(4, 1.4, 2)]
    v = exactly_once(rows, _ref(5))
    assert not v.ok
    assert v.skipped == [3] and v.duplicated == [1] and v.wrong == [2]


def test_a_final_attempt_missing_a_rows_rank_is_incomplete_not_wrong():
    rows = [*_rows(0, 1.0, 2), _rows(1, 1.1, 2)[0]]
    v = exactly_once(rows, _ref(2))
    assert v.ok and v.incomplete == 1


def test_batch_hash_is_order_free():
    assert batch_hash([3, 1, 2]) == batch_hash([1, 2, 3]) != batch_hash([1, 2, 4])


def test_available_node_seconds_integrates_the_applied_changes():
    # 2 nodes; +1 at 10 s, -1 at 15 s, -1 at 20 s; to 30 s: 2*10 + 3*5 + 2*5 + 1*10 = 55
    assert available_node_s([(15.0, -1), (10.0, +1), (20.0, -1)], 2, 30.0) == pytest.approx(55.0)


def test_audit_counts_only_final_attempts_at_their_healthy_step_time():
    t0 = 1000.0
    rows = []
    for s in range(10):  # world 2, 0.1 s a step, from t=1 s
        rows += _rows(s, t0 + 1.0 + 0.1 * s, 2)
    for s in range(8, 20):  # rolled back to step 8 at t=5 s, world 1, 0.2 s a step
        rows += _rows(s, t0 + 5.0 + 0.2 * (s - 8), 1)
    a = audit(rows, t0, [(4.0, -1)], 2, 10.0)
    assert a.step_s == {2: pytest.approx(0.1), 1: pytest.approx(0.2)}
    # finals: steps 0-7 at world 2 (8 x 2 x 0.1) + steps 8-19 at world 1 (12 x 1 x 0.2)
    assert a.useful == pytest.approx(1.6 + 2.4)
    assert a.available == pytest.approx(2 * 4.0 + 1 * 6.0)
    assert a.goodput == pytest.approx(4.0 / 14.0)
    assert a.retrained_steps == 2
    # held: world 2 from 1.0 to 5.0 (the last final step at world 2 is step 7 at 1.7 s,
    # held until the next final step at 5.0 s), then world 1 from 5.0 to 10.0
    assert a.held == pytest.approx(2 * 4.0 + 1 * 5.0)


def test_stretches_split_the_replay_where_the_pool_was_empty():
    """Two nodes from the start; the pool empties at 10 s and one node returns at 20 s. The
    first stretch trained from 1 s, the second never did: its 5 node-seconds were lost."""
    rows = [r for i in range(9) for r in _rows(i, 1.0 + i, 2)]
    changes = [(8.0, -1), (10.0, -1), (20.0, +1), (25.0, -1)]
    got = stretches(rows, 0.0, changes, 2, 30.0, {2: 1.0})
    assert [(x.start, x.end) for x in got] == [(0.0, 10.0), (20.0, 25.0)]
    assert got[0].available == pytest.approx(2 * 8.0 + 2.0)
    assert (got[0].steps, got[0].first_step_s) == (9, pytest.approx(1.0))
    assert got[0].useful == pytest.approx(9 * 2 * 1.0)
    assert (got[1].available, got[1].steps, got[1].first_step_s) == (pytest.approx(5.0), 0, None)


def test_observed_costs_of_a_cold_start_a_join_and_a_kill():
    """Two nodes from 0 s (first step at 4 s); a third arrives at 20 s and trains at 26 s;
    one is killed at 39.5 s and the next step is at 45 s; a loss at 60.5 s with an arrival
    before the next step is not an isolated kill."""
    rows = [r for i in range(16) for r in _rows(i, 4.0 + i, 2)]
    rows += [r for i in range(16, 30) for r in _rows(i, 26.0 + i - 16, 3)]
    rows += [r for i in range(30, 46) for r in _rows(i, 45.0 + i - 30, 2)]
    rows += [r for i in range(46, 50) for r in _rows(i, 62.0 + i - 46, 2)]
    changes = [(20.0, +1), (39.5, -1), (60.5, -1), (61.0, +1)]
    got = observed_costs(rows, 0.0, changes, 2, quiet_s=8.0)
    assert got.cold_start_s == [pytest.approx(4.0)]
    assert got.join_s == [pytest.approx(6.0)]
    assert got.loss_s == [pytest.approx(5.5)]


def test_busiest_window_and_its_scaled_counts():
    trace = Trace("t/x", 300.0, [4, 4, 4, 2, 4, 2, 4, 4, 4, 4])
    assert busiest_window(trace, 3 * 300 / 3600) == 2  # ticks 2..5: moves 2+2+2
    start, counts = window_counts(trace, 3 * 300 / 3600, 0.5, 8)
    assert start == 2 and counts == [2, 1, 2, 1]
    assert window_counts(trace, 3 * 300 / 3600, 1.0, 3)[1] == [3, 2, 3, 2]
