"""tests/cpu_accounting: which sampled processes' CPU a test is charged beyond what pytest
reaped, and the --cpu-durations table. Samples are built by hand: no /proc, no sleep."""

from __future__ import annotations

import pytest
from cpu_accounting import ProcSample, RunCost, Track, cpu_table, unreaped_cpu_s

ROOT = 100


def _track(ppid: int, last_s: float, *, first_s: float = 0.0, born_during: bool = True,
           ended: int | None = None, first_ppid: int | None = None) -> Track:
    return Track(ProcSample(first_ppid or ppid, first_s, 0.0), ProcSample(ppid, last_s, 0.0),
                 born_during, ended)


@pytest.mark.timeout(10)
def test_a_child_of_pytest_is_left_to_rusage_children():
    """pytest's own children reach RUSAGE_CHILDREN when reaped: never counted twice."""
    assert unreaped_cpu_s({(200, 1): _track(ROOT, 5.0, ended=3)}, ROOT) == 0.0


@pytest.mark.timeout(10)
def test_a_worker_that_ended_before_its_agent_is_in_the_agents_times():
    """A worker reaped by its living agent is in the agent's reaped times, so not added."""
    tracks = {(200, 1): _track(ROOT, 1.0, ended=9), (300, 1): _track(200, 4.0, ended=5)}
    assert unreaped_cpu_s(tracks, ROOT) == 0.0


@pytest.mark.timeout(10)
def test_a_worker_killed_with_its_agent_is_counted_whole():
    """A worker that ended with or after its agent (the node SIGKILLed) was reaped by init:
    its CPU is added, from zero when it was born during the test."""
    tracks = {(200, 1): _track(ROOT, 1.0, ended=5), (300, 1): _track(200, 4.0, ended=5),
              (301, 1): _track(200, 2.5, ended=7)}
    assert unreaped_cpu_s(tracks, ROOT) == pytest.approx(6.5)


@pytest.mark.timeout(10)
def test_a_reparented_process_counts_from_its_baseline():
    """A process seen under init (its parent gone) that was there before the test is charged
    only what it used during the test; still alive at the end, it is counted so far."""
    tracks = {(300, 1): _track(1, 7.0, first_s=3.0, born_during=False, first_ppid=200)}
    assert unreaped_cpu_s(tracks, ROOT) == pytest.approx(4.0)


@pytest.mark.timeout(10)
def test_a_process_alive_under_its_living_parent_is_left_to_whoever_reaps_it():
    """Alive at the end with its parent alive too: the parent's reaping will count it."""
    tracks = {(200, 1): _track(ROOT, 1.0), (300, 1): _track(200, 4.0)}
    assert unreaped_cpu_s(tracks, ROOT) == 0.0


@pytest.mark.timeout(10)
def test_a_reused_pid_is_a_different_process():
    """Two processes with one pid (different start times) are judged apart: the old parent
    that ended first does not cover the new child, the new living parent does."""
    tracks = {(200, 1): _track(ROOT, 1.0, ended=2), (200, 9): _track(ROOT, 1.0),
              (300, 1): _track(200, 4.0, ended=2)}
    assert unreaped_cpu_s(tracks, ROOT) == pytest.approx(4.0)


@pytest.mark.timeout(10)
def test_the_table_orders_by_cpu_cuts_to_top_and_totals_everything():
    """The table lists the top N by CPU seconds with wall and cores, then all tests' totals."""
    costs = [RunCost("a", 10.0, 2.0), RunCost("b", 4.0, 8.0), RunCost("c", 1.0, 0.5)]
    lines = cpu_table(costs, 2)
    assert [line.split()[-1] for line in lines[1:3]] == ["b", "a"]
    assert lines[1].split()[:3] == ["8.00", "4.00", "2.00"]
    assert lines[-1].split()[:3] == ["10.50", "15.00", "0.70"] and "all 3 tests" in lines[-1]
    assert len(cpu_table(costs, 0)) == 5
