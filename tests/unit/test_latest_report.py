"""Step reports: throttled, but the newest one always reaches the agent."""

from __future__ import annotations

import threading
import time

import pytest

from elasticd.control import ControlChannel, ControlClient, StepReport
from elasticd.control.client import LatestReport, StepTimes

pytestmark = pytest.mark.timeout(30)


def _report(step: int) -> StepReport:
    return StepReport(local_rank=0, rank=0, step=step, epoch=0, samples=step * 8)


class _Sent:
    """Records the steps sent; ``wait_for(step)`` returns once it went out (bounded)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self._cond = threading.Condition()

    def __call__(self, msg: StepReport) -> None:
        with self._cond:
            self.steps.append(msg.step)
            self._cond.notify_all()

    def wait_for(self, step: int, timeout_s: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: step in self.steps, timeout_s)


def test_the_first_report_goes_at_once_and_one_too_soon_is_kept_not_dropped() -> None:
    """Within the interval nothing more is sent; after it, the newest kept report is (the
    ones in between are dropped), in step order, without another call."""
    sent = _Sent()
    rep = LatestReport(sent, min_interval_s=0.2)
    try:
        rep.offer(_report(0))
        assert sent.steps == [0]
        for step in (1, 2, 3):
            rep.offer(_report(step))
        assert sent.steps == [0]  # throttled: kept, not sent
        assert sent.wait_for(3), sent.steps
        assert sent.steps == [0, 3]
    finally:
        rep.close()


def test_force_sends_at_once_and_close_sends_what_is_kept() -> None:
    sent = _Sent()
    rep = LatestReport(sent, min_interval_s=60.0)
    rep.offer(_report(0))
    rep.offer(_report(1), force=True)
    rep.offer(_report(2))
    assert sent.steps == [0, 1]
    rep.close()
    assert sent.steps == [0, 1, 2]
    rep.offer(_report(3))
    assert sent.steps == [0, 1, 2], "a report after close was sent"


def test_the_agent_learns_the_last_step_of_a_fast_loop_that_then_blocks() -> None:
    """A worker stepping every 10 ms, then blocked (a hung peer: it never reports again):
    the agent's board reaches that last step. Dropped reports left it behind, and hang
    detection named the wrong node or none."""
    chan = ControlChannel().start()
    client = ControlClient(chan.socket_path)
    rep = LatestReport(client.send, min_interval_s=0.2)
    try:
        for step in range(25):
            rep.offer(_report(step))
            time.sleep(0.01)  # the step's work
        deadline = time.monotonic() + 5.0
        while chan.progress.max_step() != 24 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert chan.progress.max_step() == 24
    finally:
        rep.close()
        client.close()
        chan.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_report_carries_the_median_time_of_the_latest_single_steps() -> None:
    """Steps of 0.05 s with a 0.5 s checkpoint save among them: the reports say 0.05 (the
    agent, one report per interval, would see 0.1 s a step); nothing before five steps,
    and a step back (a resume from older state) starts the count again."""
    msgs: list[StepReport] = []
    clock = _Clock()
    rep = LatestReport(msgs.append, min_interval_s=0.0, clock=clock)
    try:
        for step in range(10):
            clock.now += 0.5 if step == 6 else 0.05
            rep.offer(_report(step))
        assert [m.step_s for m in msgs[:5]] == [0.0] * 5  # steps 0..4: four step times
        assert msgs[5].step_s == pytest.approx(0.05)
        assert msgs[-1].step_s == pytest.approx(0.05)  # the save is one step in nine
        clock.now += 0.05
        rep.offer(_report(3))
        assert msgs[-1].step_s == 0.0
    finally:
        rep.close()


def test_step_times_are_per_step_for_reports_every_few_steps() -> None:
    """A script that reports every 10 steps of 0.1 s: 0.1 s a step, not 1 s a report."""
    times = StepTimes()
    got = [times.observe(step, 0.1 * step) for step in range(0, 100, 10)]
    assert got[-1] == pytest.approx(0.1)
