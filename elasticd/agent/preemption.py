"""Spot/preemption notice watcher: a thread that polls the cloud's metadata service.

A cloud gives a short warning before it takes a spot/preemptible machine away (AWS
2 minutes, GCP 30 seconds, Azure at least 30 seconds). Catching it turns a crash
(steps lost since the last checkpoint, survivors waiting for their lease timeouts)
into a graceful drain: the agent asks workers to stop at the next step boundary,
save, and leave the rendezvous. See docs/spot-instances.md for the timing budget.

The per-cloud HTTP and parsing live in :mod:`elasticd.agent.cloud_metadata`; this
module is the polling thread and its error policy, plus :func:`make_watcher`.

Timing contract: a notice is seen within ``poll_interval_s + timeout_s`` of the
metadata service publishing it (GCP with ``wait_for_change``: as soon as the service
answers) and reported (the drain starts) when ``drain_lead_s`` seconds are left before
its deadline, or at once when fewer are left or the cloud gives no deadline. Training
on until then is free work: every second of a notice's lead that the node spends drained
is paid for and trains nothing (docs/spot-instances.md, "When the drain starts").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from elasticd.agent.cloud_metadata import (
    DEFAULT_BASE_URLS,
    AutoDetectSource,
    AwsSpotSource,
    AzureScheduledEventsSource,
    GcpPreemptionSource,
    MetadataError,
    MetadataSource,
    NoProviderError,
    PreemptionNotice,
    detect_provider,
    make_source,
)

__all__ = [
    "DEFAULT_BASE_URLS",
    "AutoDetectSource",
    "AwsSpotSource",
    "AzureScheduledEventsSource",
    "GcpPreemptionSource",
    "MetadataError",
    "MetadataSource",
    "NoProviderError",
    "PreemptionNotice",
    "PreemptionWatcher",
    "detect_provider",
    "make_source",
    "make_watcher",
]

log = structlog.get_logger(__name__)


# --- when to drain ----------------------------------------------------------------


#: The longest a notice may make the drain wait: a deadline further out than this (a
#: skewed clock, a bogus metadata answer) is not trusted to train on for.
MAX_DRAIN_DELAY_S = 600.0


def drain_delay_s(notice: PreemptionNotice, drain_lead_s: float | None,
                  now: float | None = None) -> float:
    """Seconds to train on after ``notice`` before draining, so that the drain starts with
    ``drain_lead_s`` seconds left before the deadline (0: drain now).

    ``drain_lead_s`` None, a notice without a deadline, or one with less than
    ``drain_lead_s`` left drains at once; the wait is at most :data:`MAX_DRAIN_DELAY_S`.
    """
    left = notice.seconds_left(now)
    if drain_lead_s is None or left is None:
        return 0.0
    return min(MAX_DRAIN_DELAY_S, max(0.0, left - drain_lead_s))


# --- the watcher thread ----------------------------------------------------------


class PreemptionWatcher:
    """A daemon thread that polls a :class:`MetadataSource` and reports the first notice.

    ``on_notice`` runs once, on the watcher thread, when the drain should start
    (:func:`drain_delay_s` after the notice is seen); it should only record the notice
    and wake the agent loop (the loop starts the drain). Poll failures are logged once
    per change of error state, not on every poll, and never stop the watcher.
    """

    def __init__(self, source: MetadataSource, poll_interval_s: float = 2.0,
                 drain_lead_s: float | None = None) -> None:
        if poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be positive")
        if drain_lead_s is not None and drain_lead_s < 0:
            raise ValueError("drain_lead_s must not be negative")
        self.source = source
        self.poll_interval_s = poll_interval_s
        self.drain_lead_s = drain_lead_s
        self.notice: PreemptionNotice | None = None
        self.polls = 0  # polls completed (successfully or not); for tests and status
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_notice: Callable[[PreemptionNotice], None]) -> None:
        """Start polling in a daemon thread. Call once."""
        if self._thread is not None:
            raise RuntimeError("PreemptionWatcher already started")
        self._thread = threading.Thread(
            target=self._run, args=(on_notice,), name=f"preemption-{self.source.provider}",
            daemon=True,
        )
        self._thread.start()
        log.info("preemption_watcher_started", provider=self.source.provider,
                 poll_interval_s=self.poll_interval_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop polling and wait up to ``timeout_s`` for the thread (a request in flight
        is bounded by the source's HTTP timeout)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        """True while the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self, on_notice: Callable[[PreemptionNotice], None]) -> None:
        while not self._stop.is_set():
            try:
                notice = self.poll_once()
            except NoProviderError as exc:
                log.info("preemption_provider_not_detected", reason=str(exc))
                return
            if notice is not None:
                # Train on while the notice leaves more than the lead (a stop ends the wait).
                delay = drain_delay_s(notice, self.drain_lead_s)
                if delay > 0 and self._stop.wait(delay):
                    return
                try:
                    on_notice(notice)
                except Exception:
                    log.exception("preemption_callback_failed", provider=notice.provider)
                return
            # A long-polling source (GCP wait_for_change) already waited in the request;
            # after an error, always pause so a dead service is not hammered.
            long_poll = getattr(self.source, "long_poll", False)
            self._stop.wait(self.poll_interval_s if self.last_error or not long_poll else 0)

    def poll_once(self) -> PreemptionNotice | None:
        """Poll the source once (the thread's body; also usable without the thread).

        Failures are swallowed into ``last_error`` and logged only when the error
        changes; a notice is stored in ``notice`` and logged.

        Raises:
            NoProviderError: auto-detection found no cloud; stop polling.
        """
        try:
            notice = self.source.poll()
        except NoProviderError:
            raise
        except Exception as exc:  # a watcher must outlive any poll failure
            self.polls += 1
            error = f"{type(exc).__name__}: {exc}"
            if error != self.last_error:
                log.warning("preemption_poll_failed", provider=self.source.provider, error=error)
            self.last_error = error
            return None
        self.polls += 1
        if self.last_error is not None:
            log.info("preemption_poll_recovered", provider=self.source.provider)
            self.last_error = None
        if notice is not None:
            self.notice = notice
            log.warning("preemption_notice_received", provider=notice.provider,
                        deadline=notice.deadline, seconds_left=notice.seconds_left(),
                        drain_in_s=round(drain_delay_s(notice, self.drain_lead_s, time.time()), 1),
                        detail=notice.detail)
        return notice


def make_watcher(
    provider: str,
    *,
    base_url: str | None = None,
    poll_interval_s: float = 2.0,
    timeout_s: float = 2.0,
    drain_lead_s: float | None = None,
) -> PreemptionWatcher | None:
    """Build the watcher for ``[preemption]`` settings; None for ``provider = "none"``.

    Usage: ``make_watcher(cfg.provider, base_url=cfg.base_url,
    poll_interval_s=cfg.poll_interval_s)``.
    """
    if provider == "none":
        return None
    return PreemptionWatcher(make_source(provider, base_url, timeout_s=timeout_s), poll_interval_s,
                             drain_lead_s)
