"""Unit tests of AgentMetrics: values, restart causes, step rate from a fake clock."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from elasticd.status.metrics import RESTART_CAUSES, AgentMetrics


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def value(m: AgentMetrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, labels or None)


def test_gauges_counters_and_histograms_record_calls():
    """Each agent call lands in its documented series."""
    m = AgentMetrics()
    m.set_identity(job="demo", node="n1", version="0.1.0")
    m.set_round(7)
    m.set_world_size(16)
    m.restart("failure")
    m.restart("failure")
    m.restart("membership")
    m.observe_rendezvous_s(1.5)
    m.observe_recovery_s(12.0)
    m.observe_checkpoint_save(2.0, 1000)
    m.observe_checkpoint_save(3.0, 500)
    m.observe_checkpoint_load(1.0, 1500)
    m.set_last_checkpoint_step(4000, committed_at=1_750_000_000.0)
    assert value(m, "elasticd_round") == 7 and value(m, "elasticd_world_size") == 16
    assert value(m, "elasticd_restarts_total", cause="failure") == 2
    assert value(m, "elasticd_restarts_total", cause="membership") == 1
    assert value(m, "elasticd_restarts_total", cause="hang") == 0  # exported before use
    assert value(m, "elasticd_rendezvous_duration_seconds_sum") == 1.5
    assert value(m, "elasticd_rendezvous_duration_seconds_bucket", le="2.5") == 1
    assert value(m, "elasticd_recovery_duration_seconds_count") == 1
    assert value(m, "elasticd_checkpoint_save_duration_seconds_count") == 2
    assert value(m, "elasticd_checkpoint_save_bytes_total") == 1500
    assert value(m, "elasticd_checkpoint_last_save_bytes") == 500
    assert value(m, "elasticd_checkpoint_load_bytes_total") == 1500
    assert value(m, "elasticd_last_checkpoint_step") == 4000
    assert value(m, "elasticd_last_checkpoint_timestamp_seconds") == 1_750_000_000.0
    assert value(m, "elasticd_agent_info", elasticd_job="demo", node="n1", version="0.1.0") == 1


def test_unknown_restart_cause_is_a_caller_bug():
    """Only the documented causes are accepted, so label values stay bounded."""
    with pytest.raises(ValueError, match="cause"):
        AgentMetrics().restart("oops")
    assert RESTART_CAUSES == ("failure", "membership", "hang")


def test_step_rate_is_averaged_over_the_interval():
    """The step rate is steps advanced over time elapsed, updated once per interval."""
    clock = FakeClock()
    m = AgentMetrics(clock=clock, rate_interval_s=5.0)
    m.set_step(100, samples=6400)
    clock.t += 2
    m.set_step(110, samples=7040)
    assert value(m, "elasticd_training_steps_per_second") == 0  # interval not reached
    clock.t += 3
    m.set_step(150, samples=9600)
    assert value(m, "elasticd_training_steps_per_second") == 10.0
    assert value(m, "elasticd_training_step") == 150
    assert value(m, "elasticd_training_samples_per_second") == 640.0  # (9600 - 6400) / 5 s


def test_sample_rate_needs_samples_reported():
    """Workers that report no samples leave samples/s unset rather than fake a rate."""
    clock = FakeClock()
    m = AgentMetrics(clock=clock, rate_interval_s=1.0)
    m.set_step(0)
    clock.t += 2
    m.set_step(20)
    assert value(m, "elasticd_training_samples_per_second") == 0


def test_step_going_back_restarts_the_rate_measurement():
    """After a resume from an older checkpoint the rate is measured afresh, never negative."""
    clock = FakeClock()
    m = AgentMetrics(clock=clock, rate_interval_s=1.0)
    m.set_step(1000)
    clock.t += 10
    m.set_step(1100)
    assert value(m, "elasticd_training_steps_per_second") == 10.0
    m.set_step(900)  # resumed from checkpoint
    clock.t += 2
    m.set_step(910)
    assert value(m, "elasticd_training_steps_per_second") == 5.0


def test_registries_are_private():
    """Two agents in one process keep separate metrics; the default registry is untouched."""
    a, b = AgentMetrics(), AgentMetrics()
    a.set_round(1)
    b.set_round(2)
    assert value(a, "elasticd_round") == 1 and value(b, "elasticd_round") == 2
    assert b"elasticd_round 2.0" in generate_latest(b.registry)
