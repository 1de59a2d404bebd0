"""Unit tests of elasticd.retry: backoff, deadline, stop event and what is retried (no real sleep)."""

from __future__ import annotations

import threading

import pytest
from structlog.testing import capture_logs

from elasticd.errors import ConfigError, EtcdUnavailableError, TransientError
from elasticd.retry import call_with_retry, restart_backoff_s, transient_retrying


class FakeTime:
    """A monotonic clock that only moves when the code under test sleeps (or a call 'takes' time)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky:
    """A callable that raises ``errors`` in turn, then returns ``result``."""

    def __init__(self, errors: list[BaseException], result: object = "ok",
                 clock: FakeTime | None = None, call_s: float = 0.0) -> None:
        self.errors = list(errors)
        self.result = result
        self.calls = 0
        self.clock, self.call_s = clock, call_s

    def __call__(self) -> object:
        self.calls += 1
        if self.clock is not None:
            self.clock.now += self.call_s
        if self.errors:
            raise self.errors.pop(0)
        return self.result


def test_transient_errors_are_retried_until_success():
    """Transient errors are retried with backoff and the eventual result is returned."""
    t = FakeTime()
    fn = Flaky([EtcdUnavailableError("down")] * 3)
    retrying = transient_retrying(what="t", deadline=t.now + 60, sleep=t.sleep, clock=t.clock)
    assert retrying(fn) == "ok"
    assert fn.calls == 4
    assert len(t.sleeps) == 3


@pytest.mark.parametrize("error", [ConfigError("bad"), ValueError("bug"), KeyError("k")])
def test_non_transient_errors_are_not_retried(error):
    """Config errors and programming errors surface on the first attempt, unchanged."""
    t = FakeTime()
    fn = Flaky([error])
    with pytest.raises(type(error)):
        transient_retrying(what="t", deadline=t.now + 60, sleep=t.sleep, clock=t.clock)(fn)
    assert fn.calls == 1
    assert t.sleeps == []


def test_backoff_grows_and_is_capped():
    """Backoff sleeps start near initial_s, grow, and never exceed max_s."""
    t = FakeTime()
    fn = Flaky([TransientError("x")] * 12)
    retrying = transient_retrying(what="t", deadline=t.now + 1e6, sleep=t.sleep, clock=t.clock,
                                  initial_s=0.1, max_s=2.0)
    assert retrying(fn) == "ok"
    assert 0.1 <= t.sleeps[0] <= 0.2
    assert all(s <= 2.0 for s in t.sleeps)
    assert t.sleeps[-1] >= 1.0, f"backoff did not grow: {t.sleeps}"


def test_deadline_stops_retrying_and_reraises_last_error():
    """At the deadline the last transient error is raised, and no sleep runs past the deadline."""
    t = FakeTime()
    deadline = t.now + 5.0
    errors = [EtcdUnavailableError(f"down {i}") for i in range(1000)]
    fn = Flaky(errors, clock=t, call_s=0.1)
    with pytest.raises(EtcdUnavailableError) as info:
        transient_retrying(what="t", deadline=deadline, sleep=t.sleep, clock=t.clock,
                           initial_s=0.05, max_s=1.0)(fn)
    assert info.value is not None and str(info.value) == f"down {fn.calls - 1}"
    assert fn.calls > 3
    # Sleeps never cross the deadline; only the last attempt's own duration may.
    assert t.now <= deadline + 0.1 + 1e-9


def test_deadline_in_the_past_makes_exactly_one_attempt():
    """call_with_retry with an expired deadline tries once and raises the error (no sleep)."""
    fn = Flaky([EtcdUnavailableError("down")] * 5)
    slept: list[float] = []
    with pytest.raises(EtcdUnavailableError):
        call_with_retry(fn, what="t", deadline=0.0, sleep=slept.append)
    assert fn.calls == 1 and slept == []


def test_stop_event_already_set_means_no_retry():
    """With the stop event set, a failing call is not retried and its error is raised."""
    stop = threading.Event()
    stop.set()
    fn = Flaky([EtcdUnavailableError("down")] * 5)
    with pytest.raises(EtcdUnavailableError):
        call_with_retry(fn, what="t", deadline=1e18, stop=stop)
    assert fn.calls == 1


class _StopsWhileSleeping(threading.Event):
    """A stop event that gets set during the first backoff sleep, which returns at once."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        self.set()
        return True


def test_stop_event_interrupts_backoff():
    """A backoff sleep waits on the stop event (a shutdown wakes it), and retrying ends once
    the stop is seen: at most one attempt follows the stop."""
    stop = _StopsWhileSleeping()
    fn = Flaky([TransientError("x")] * 100)
    with pytest.raises(TransientError):
        call_with_retry(fn, what="t", deadline=1e18, stop=stop, sleep=lambda s: pytest.fail("slept"))
    assert len(stop.waits) == 1
    assert fn.calls <= 2


def test_stop_event_does_not_hide_a_success():
    """A call that succeeds returns its value even when a stop event is given."""
    assert call_with_retry(lambda: 42, what="t", deadline=1e18, stop=threading.Event()) == 42


def test_retrying_warns_once_per_call():
    """A run of transient failures logs one warning naming the operation, not one per attempt."""
    t = FakeTime()
    fn = Flaky([EtcdUnavailableError("down")] * 4)
    with capture_logs() as logs:
        transient_retrying(what="join round", deadline=t.now + 60, sleep=t.sleep, clock=t.clock)(fn)
    warnings = [e for e in logs if e["event"] == "transient_error_retrying"]
    assert len(warnings) == 1
    assert warnings[0]["during"] == "join round"


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(0, 1.0), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (50, 10.0)],
)
def test_restart_backoff_doubles_and_caps(attempt, expected):
    """Restart backoff is initial * 2**(attempt-1), capped at max_s (attempt 0 counts as 1)."""
    assert restart_backoff_s(attempt, initial_s=1.0, max_s=10.0) == pytest.approx(expected)


def test_restart_backoff_zero_initial_means_no_wait():
    """initial_s=0 disables the restart backoff."""
    assert restart_backoff_s(3, initial_s=0.0, max_s=10.0) == 0.0
