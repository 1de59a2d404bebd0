"""The automatic checkpoint cadence: Young–Daly from measured cost and observed losses,
bounded by the overhead cap and the write time."""

from __future__ import annotations

import math

import pytest

from elasticd.checkpoint.cadence import interval_steps, young_daly_interval

pytestmark = pytest.mark.timeout(10)


def test_the_interval_is_young_daly_when_within_bounds():
    """20 ms blocking, one loss an hour: sqrt(2 * 0.02 * 3600) = 12 s, above the 1 % cap's
    2 s and the 1 s write, so Young–Daly's 12 s stands."""
    c = young_daly_interval(0.02, 1.0, losses=4, observed_s=4 * 3600)
    assert c.interval_s == pytest.approx(math.sqrt(2 * 0.02 * 3600))
    assert c.mtbf_s == 3600 and "Young" in c.reason


def test_the_overhead_cap_bounds_a_frequent_loss_rate():
    """Losses every 10 s would ask for a save every 0.6 s; blocking 20 ms caps it at 2 s (1 %)."""
    c = young_daly_interval(0.02, 0.1, losses=100, observed_s=1000)
    assert c.interval_s == pytest.approx(2.0) and "overhead cap" in c.reason
    assert 0.02 / c.interval_s <= 0.01 + 1e-12


def test_saves_never_overlap_their_writes():
    """A 30 s write bounds the interval from below even when Young–Daly says less."""
    c = young_daly_interval(0.01, 30.0, losses=10, observed_s=3600)
    assert c.interval_s == 30.0 and "write time" in c.reason


def test_no_loss_yet_assumes_one_over_the_span_and_is_capped():
    """No loss in two weeks: one is assumed (MTBF = two weeks), and the interval is capped."""
    c = young_daly_interval(10.0, 5.0, losses=0, observed_s=14 * 86400, max_interval_s=3600)
    assert c.mtbf_s == 14 * 86400 and c.interval_s == 3600 and "capped" in c.reason


def test_bad_inputs_are_refused():
    """Negative costs or an overhead outside (0, 1] raise ValueError."""
    with pytest.raises(ValueError):
        young_daly_interval(-1, 0, 0, 10)
    with pytest.raises(ValueError):
        young_daly_interval(0.1, 0, 0, 10, max_overhead=0)


def test_steps_round_the_interval_and_are_at_least_one():
    """12 s at 0.5 s a step is 24 steps; a tiny interval is still one step."""
    assert interval_steps(12.0, 0.5) == 24
    assert interval_steps(0.1, 1.0) == 1
    assert interval_steps(5.0, 0.0) == 1
