"""The automatic checkpoint cadence: Young–Daly from measured cost and observed losses,
bounded by the overhead cap and the write time."""

from __future__ import annotations

import math

import pytest

from elasticd.checkpoint.cadence import (
    MIN_LOSSLESS_SPAN_S,
    choose_save_every,
    interval_steps,
    parse_every,
    parse_losses,
    young_daly_interval,
)

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


def test_auto_saves_every_first_steps_until_a_save_was_measured():
    """Before a save has measured its cost (or a step its time) the cadence is the script's
    save_every, and says so."""
    c = choose_save_every(blocking_s=None, write_s=0.0, step_time_s=0.5, losses=0,
                          observed_s=0.0, first_every=50)
    assert c.every_steps == 50 and "until a save has measured" in c.reason
    c = choose_save_every(blocking_s=0.02, write_s=1.0, step_time_s=0.0, losses=3,
                          observed_s=3600, first_every=50)
    assert c.every_steps == 50


def test_auto_is_young_daly_in_whole_steps_rounded_up():
    """20 ms blocking, one loss an hour, 0.5 s steps: Young–Daly's 12 s is 24 steps; a
    fraction of a step rounds up so the overhead cap still holds."""
    c = choose_save_every(blocking_s=0.02, write_s=1.0, step_time_s=0.5, losses=4,
                          observed_s=4 * 3600, first_every=50)
    assert c.every_steps == 24 and c.interval_s == pytest.approx(12.0)
    assert "Young" in c.reason and "MTBF 3600 s" in c.reason
    c = choose_save_every(blocking_s=0.02, write_s=1.0, step_time_s=0.7, losses=4,
                          observed_s=4 * 3600, first_every=50)
    assert c.every_steps == math.ceil(12.0 / 0.7)


def test_auto_bounds_the_overhead_to_one_percent_and_never_overlaps_writes():
    """Frequent losses would ask for saves more often than the loop can afford: the
    interval is at least blocking / 1 % and at least the write time."""
    c = choose_save_every(blocking_s=0.05, write_s=0.1, step_time_s=0.1, losses=1000,
                          observed_s=1000, first_every=50)
    assert c.interval_s >= 0.05 / 0.01 and "overhead cap" in c.reason
    c = choose_save_every(blocking_s=0.001, write_s=30.0, step_time_s=1.0, losses=1000,
                          observed_s=1000, first_every=50)
    assert c.every_steps == 30 and "write time" in c.reason


def test_a_young_job_without_losses_assumes_one_over_ten_minutes_not_its_age():
    """A job 5 s old with no loss does not save every few steps: the lossless span counts
    as at least MIN_LOSSLESS_SPAN_S; a loss already seen is taken at its real rate."""
    c = choose_save_every(blocking_s=0.02, write_s=0.1, step_time_s=0.1, losses=0,
                          observed_s=5.0, first_every=50)
    assert c.interval_s == pytest.approx(math.sqrt(2 * 0.02 * MIN_LOSSLESS_SPAN_S), rel=0.02)
    quick = choose_save_every(blocking_s=0.02, write_s=0.1, step_time_s=0.1, losses=1,
                              observed_s=100.0, first_every=50)
    assert quick.every_steps < c.every_steps


@pytest.mark.parametrize(("text", "expected"), [
    (None, None), ("", None), (" auto ", "auto"), ("AUTO", "auto"), ("200", 200), ("1", 1)])
def test_every_parses_auto_steps_or_unset(text, expected):
    """ELASTICD_CHECKPOINT_EVERY as a worker reads it: "auto", steps >= 1, or unset."""
    assert parse_every(text) == expected


@pytest.mark.parametrize("text", ["0", "-3", "often", "1.5"])
def test_every_refuses_anything_else_naming_the_forms(text):
    """A bad value names the accepted forms."""
    with pytest.raises(ValueError, match='"auto" or a whole number'):
        parse_every(text)


def test_observed_losses_parse_or_are_ignored():
    """"<losses>/<seconds>" from the agent; a malformed value is no information, not an error."""
    assert parse_losses("3/7200") == (3, 7200.0)
    assert parse_losses(None) is None and parse_losses("x/1") is None
    assert parse_losses("3") is None and parse_losses("-1/5") is None and parse_losses("1/nan") is None
