"""Unit tests of the job's progress history record: when a sample is due, the bound, the codec."""

from __future__ import annotations

import json

import pytest

from elasticd.history import MAX_SAMPLES, History, Sample, append_sample


def _s(t: float, step: int = 0, world: int = 2, loss: float | None = None) -> Sample:
    return Sample(t=t, step=step, world_size=world, samples_per_s=10.0, round=1, loss=loss)


def test_sample_is_due_only_after_the_interval():
    """A sample sooner than interval_s after the last one is not taken; one at the interval is."""
    h = append_sample(History(interval_s=5.0), _s(100.0))
    assert h is not None and len(h.samples) == 1
    assert append_sample(h, _s(104.9)) is None
    h2 = append_sample(h, _s(105.0, step=3))
    assert h2 is not None and [s.step for s in h2.samples] == [0, 3]


def test_world_size_change_is_taken_at_once():
    """A resize is sampled immediately, whatever the interval (it is what the picture shows)."""
    h = append_sample(History(interval_s=5.0), _s(100.0, world=2))
    assert h is not None
    h2 = append_sample(h, _s(101.0, world=1))
    assert h2 is not None and [s.world_size for s in h2.samples] == [2, 1]


def test_time_never_goes_backwards():
    """A sample older than the last one (clock step, slower writer) is refused."""
    h = append_sample(History(), _s(100.0))
    assert h is not None
    assert append_sample(h, _s(99.0, world=7)) is None


def test_full_history_halves_and_doubles_its_interval():
    """Past max_samples every other sample goes (newest kept) and the interval doubles: bounded forever."""
    h = History(interval_s=1.0)
    for t in range(1, 20_001):  # a sample offered every second, as the agent does (5 s there)
        new = append_sample(h, _s(float(t), step=t), max_samples=64)
        h = new if new is not None else h
        assert len(h.samples) <= 64
    assert h.samples[-1].step >= 20_000 - h.interval_s  # the newest is (nearly) now
    assert h.samples[0].t <= 2 * h.interval_s  # and it still covers the whole run
    assert 20_000 / 64 <= h.interval_s <= 2 * 20_000 / 32  # resolution ~ age / max_samples


def test_json_round_trip_and_size_bound():
    """A full record round-trips through JSON and stays small (it is rewritten every few seconds)."""
    samples = tuple(Sample(t=1.8e9 + i * 5.123456, step=10_000_000 + i, world_size=512,
                           samples_per_s=123456.789, round=99, loss=0.123456789,
                           checkpoint_step=9_999_000, step_s=0.0123456) for i in range(MAX_SAMPLES))
    h = History(interval_s=5.0, samples=samples)
    text = h.to_json()
    assert len(text) < 72 * MAX_SAMPLES  # ~35 KB: far below etcd's 1.5 MB request limit
    back = History.from_json(text)
    assert back.interval_s == 5.0 and len(back.samples) == MAX_SAMPLES
    assert back.samples[3].step == 10_000_003 and back.samples[3].loss == pytest.approx(0.123457)
    assert back.samples[3].step_s == pytest.approx(0.01235)
    one = History.from_json(History(samples=(Sample(t=1.0, step=0, world_size=1, round=0),)).to_json())
    assert one.samples[0].loss is None and one.samples[0].round == 0 and one.samples[0].step == 0
    assert one.samples[0].step_s is None


@pytest.mark.parametrize("raw", [
    "not json", "[]", '{"v": 2, "interval_s": 5, "fields": [], "rows": []}',
    '{"v": 1, "interval_s": -1, "fields": ["t", "step", "world_size"], "rows": []}',
    '{"v": 1, "interval_s": 5, "fields": ["t", "step"], "rows": []}',
    '{"v": 1, "interval_s": 5, "fields": ["t", "step", "world_size"], "rows": [["x", 1, 2]]}',
    '{"v": 1, "interval_s": 5, "fields": ["t", "step", "world_size"], "rows": [{"t": 1}]}',
    '{"v": 1, "interval_s": 5, "fields": ["t", "step", "world_size"], "rows": [[1, null, 2]]}',
])
def test_malformed_records_are_refused(raw):
    """Records read from etcd are validated: anything malformed raises ValueError, never a crash later."""
    with pytest.raises(ValueError):
        History.from_json(raw)


def test_unknown_columns_are_ignored():
    """A newer agent's extra column does not break an older reader."""
    raw = json.dumps({"v": 1, "interval_s": 5, "fields": ["t", "step", "world_size", "new"],
                      "rows": [[1.0, 2, 3, "x"]]})
    assert History.from_json(raw).samples[0].step == 2
