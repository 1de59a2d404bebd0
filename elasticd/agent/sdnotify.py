"""systemd readiness and watchdog notifications (sd_notify), without dependencies.

With ``Type=notify`` systemd considers the agent started only when it says
``READY=1``, shows its ``STATUS=`` line in ``systemctl status``, restarts it when
``WATCHDOG=1`` pings stop (a hung agent loop), and, on ``STOPPING=1`` plus
``EXTEND_TIMEOUT_USEC``, knows a slow drain is progress and not a hang.

The protocol is one datagram of ``KEY=VALUE`` lines to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). This module does
not read the environment: the CLI passes ``os.environ.get("NOTIFY_SOCKET")`` in.
Without a socket every call is a no-op returning False, so the agent runs the same
under systemd, in a terminal and in tests.

Notifications never raise: a lost status line must not take the agent down. The
first failure is logged once (and again only after a success).

``NotifyAccess=main`` in the unit means only the agent's own PID may notify; this
module must be used from the agent process (any thread), never from workers.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

# systemd caps a notification datagram; a status line is for humans, keep it short.
MAX_STATUS_CHARS = 512


class SystemdNotifier:
    """Sends sd_notify messages to one socket.

    Args:
        socket_path: the value of ``$NOTIFY_SOCKET``, or None/"" when not under systemd.
        watchdog_usec: ``$WATCHDOG_USEC``, if any; sets :attr:`watchdog_interval_s`.
        watchdog_pid: ``$WATCHDOG_PID``, if any (see :func:`watchdog_interval_s`).
        pid: this process's PID, to match ``watchdog_pid``.
        clock: monotonic clock (tests).

    Attributes:
        watchdog_interval_s: how often to ping (half of ``WatchdogSec``), or None when
            systemd expects no pings.
    """

    def __init__(
        self,
        socket_path: str | None,
        watchdog_usec: str | None = None,
        watchdog_pid: str | None = None,
        *,
        pid: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path or None
        self.watchdog_interval_s = watchdog_interval_s(watchdog_usec, watchdog_pid, pid=pid)
        self._clock = clock
        self._last_ping: float | None = None
        self._address: str | None = None
        if self.socket_path is not None:
            # "@name" is Linux's abstract namespace, spelled with a leading NUL byte.
            self._address = (
                "\0" + self.socket_path[1:] if self.socket_path.startswith("@") else self.socket_path
            )
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failing = False

    @property
    def enabled(self) -> bool:
        """True when running under a service manager that listens for notifications."""
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram.

        Returns:
            True if the datagram was sent; False when disabled or on failure.
        """
        if self._address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode("utf-8", "replace")
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(
                        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    )
                    # Never block the agent loop: a receiver that stopped reading fills its
                    # queue (10 datagrams by default) and a blocking send would wait forever.
                    # A message that does not fit is dropped (and logged once).
                    self._sock.setblocking(False)
                self._sock.sendto(payload, self._address)
            except OSError as exc:
                if not self._failing:
                    log.warning("sd_notify_failed", socket=self.socket_path, error=str(exc))
                self._failing = True
                return False
            self._failing = False
            return True

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd the agent is up (``READY=1``), optionally with a status line."""
        return self.notify("READY=1", *self._status(status))

    def status(self, text: str) -> bool:
        """Set the one-line status shown by ``systemctl status``."""
        return self.notify(*self._status(text))

    def watchdog(self) -> bool:
        """Ping the watchdog (``WATCHDOG=1``).

        Safe to call on every pass of a fast loop: when :attr:`watchdog_interval_s` is
        known, pings closer together than a quarter of it are skipped (returns False),
        so the loop's liveness still reaches systemd well within ``WatchdogSec``.
        """
        now = self._clock()
        if (
            self.watchdog_interval_s is not None
            and self._last_ping is not None
            and now - self._last_ping < self.watchdog_interval_s / 4
        ):
            return False
        sent = self.notify("WATCHDOG=1")
        if sent:
            self._last_ping = now
        return sent

    def stopping(self, status: str | None = None) -> bool:
        """Tell systemd a graceful stop has begun (``STOPPING=1``)."""
        return self.notify("STOPPING=1", *self._status(status))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before systemd's start/stop timeout fires
        (``EXTEND_TIMEOUT_USEC``); repeat before it runs out to keep extending."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def close(self) -> None:
        """Close the socket; later calls reopen it."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    @staticmethod
    def _status(text: str | None) -> tuple[str, ...]:
        if text is None:
            return ()
        # One datagram line per assignment: a newline would start a bogus assignment.
        line = " ".join(text.split())[:MAX_STATUS_CHARS]
        return (f"STATUS={line}",)


def watchdog_interval_s(
    watchdog_usec: str | None, watchdog_pid: str | None = None, *, pid: int | None = None
) -> float | None:
    """How often to send ``WATCHDOG=1``: half of systemd's ``WatchdogSec``.

    Half, as sd_watchdog_enabled(3) recommends, so one late ping is not yet fatal.

    Args:
        watchdog_usec: ``$WATCHDOG_USEC`` (passed in by the caller).
        watchdog_pid: ``$WATCHDOG_PID``; when set, the watchdog is only ours if it
            equals ``pid``.
        pid: this process's PID (``os.getpid()``); required to check ``watchdog_pid``.

    Returns:
        Seconds between pings, or None when the watchdog is off or meant for another
        process (or the values are malformed).
    """
    try:
        usec = int(watchdog_usec) if watchdog_usec else 0
    except ValueError:
        return None
    if usec <= 0:
        return None
    if watchdog_pid:
        try:
            if pid is None or int(watchdog_pid) != pid:
                return None
        except ValueError:
            return None
    return usec / 2 / 1_000_000
