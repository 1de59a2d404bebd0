"""Retry strategies (tenacity) for transient errors: one place, composable, stoppable.

Every etcd call that may fail transiently goes through ``call_with_retry``: jittered
exponential backoff, an absolute deadline, and an optional ``threading.Event`` that stops
the retrying promptly (a daemon shutting down must not sit out a backoff). The sleep is
injectable so policies are unit-tested without real time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import structlog
import tenacity

from elasticd.errors import TransientError

T = TypeVar("T")
log = structlog.get_logger(__name__)


class _StopAtDeadline(tenacity.stop.stop_base):
    """Stop when the next sleep would pass an absolute ``time.monotonic()`` deadline."""

    def __init__(self, deadline: float, clock: Callable[[], float]) -> None:
        self.deadline = deadline
        self.clock = clock

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        upcoming = retry_state.upcoming_sleep or 0.0
        return self.clock() + upcoming >= self.deadline


class _StopOnEvent(tenacity.stop.stop_base):
    def __init__(self, event: threading.Event | None) -> None:
        self.event = event

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return bool(self.event is not None and self.event.is_set())


def transient_retrying(*, what: str, deadline: float, stop: threading.Event | None = None,
                       sleep: Callable[[float], None] = time.sleep,
                       clock: Callable[[], float] = time.monotonic,
                       initial_s: float = 0.05, max_s: float = 1.0,
                       warn: bool = True) -> tenacity.Retrying:
    """A ``tenacity.Retrying`` for ``TransientError`` until ``deadline`` (monotonic) or ``stop``.

    ``warn=False``: the caller has said what it waits for itself (no generic warning).
    """
    state = {"warned": not warn}

    def before_sleep(rs: tenacity.RetryCallState) -> None:
        if not state["warned"]:
            exc = rs.outcome.exception() if rs.outcome else None
            log.warning("transient_error_retrying", during=what, error=str(exc))
            state["warned"] = True

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(TransientError),
        # exponential plus up to `initial_s` of jitter, never above `max_s` in total
        wait=(tenacity.wait_exponential(multiplier=initial_s, max=max(max_s - initial_s, initial_s))
              + tenacity.wait_random(0, min(initial_s, max_s))),
        stop=_StopAtDeadline(deadline, clock) | _StopOnEvent(stop),
        sleep=sleep if stop is None else (lambda s: None if stop.wait(s) else None),
        before_sleep=before_sleep,
        reraise=True,
    )


def call_with_retry(fn: Callable[[], T], *, what: str, deadline: float,
                    stop: threading.Event | None = None,
                    sleep: Callable[[float], None] = time.sleep, warn: bool = True) -> T:
    """Call ``fn`` until it succeeds, a non-transient error, ``deadline`` or ``stop``.

    Raises:
        TransientError: the last transient error, once the deadline passed.
    """
    return transient_retrying(what=what, deadline=deadline, stop=stop, sleep=sleep,
                              warn=warn)(fn)


def restart_backoff_s(attempt: int, initial_s: float, max_s: float) -> float:
    """Backoff before the ``attempt``-th restart (1-based): initial * 2**(attempt-1), capped."""
    wait = tenacity.wait_exponential(multiplier=initial_s, exp_base=2, min=0, max=max_s)
    rs = tenacity.RetryCallState(tenacity.Retrying(), fn=None, args=(), kwargs={})
    rs.attempt_number = max(attempt, 1)
    return float(min(wait(rs), max_s)) if initial_s > 0 else 0.0
