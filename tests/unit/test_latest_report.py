"""Step reports: throttled, but the newest one always reaches the agent."""

from __future__ import annotations

import threading
import time

import pytest

from elasticd.control import ControlChannel, ControlClient, StepReport
from elasticd.control.client import LatestReport

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
