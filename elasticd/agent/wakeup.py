"""Wake the agent's tick at once on the events that end a wait, instead of at the next poll.

The agent loop looks at its workers, etcd's view and the control directory once per
``monitor_interval_s`` (0.1 s). On the drain path three of those looks were on the
critical path, each costing half an interval on average: the stop signal, the drained
node's workers exiting (then the node leaves and the survivors re-form), and on the
survivors the watch event that shows a node left or a round opened. :class:`TickWaker`
turns each into an immediate tick without polling faster:

- **signals**: ``signal.set_wakeup_fd`` makes Python's C-level handler write a byte to a
  pipe for every signal that has a Python handler (SIGTERM, SIGINT: the agent's flags-only
  handlers), whichever thread the kernel delivered it to;
- **a worker exits**: a no-op SIGCHLD handler (installed with ``SA_RESTART``, so no other
  thread's system call sees ``EINTR``) makes every child's exit such a signal;
- **other threads** (the etcd watch, the control server) call :meth:`TickWaker.wake`,
  which writes a byte too.

The loop waits with :meth:`TickWaker.wait` (``select`` on the pipe, bounded by the tick
interval): a tick still runs at least once per interval, and a wake-up only makes the
next one come sooner. Signal handlers still only set flags (docs: Patroni's rule).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from types import FrameType
from typing import Any


class TickWaker:
    """A self-pipe that ends the agent loop's wait early.

    Only the main thread may :meth:`install` and :meth:`uninstall` (Python's rule for
    signal handlers); :meth:`wake` is safe from any thread.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)  # set_wakeup_fd needs it; a full pipe is a wake-up already
        self._old_fd: int | None = None
        self._old_chld: Any = None
        self._installed = False
        self.wakeups = 0  # waits ended early (tests, logs)

    def install(self) -> None:
        """Route signals and child exits to the pipe (main thread; idempotent)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._old_chld = signal.signal(signal.SIGCHLD, _child_exited)
        signal.siginterrupt(signal.SIGCHLD, False)  # SA_RESTART: no EINTR in other threads
        self._installed = True

    def uninstall(self) -> None:
        """Restore the previous wake-up fd and SIGCHLD disposition (main thread)."""
        if not self._installed:
            return
        self._installed = False
        signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
        signal.signal(signal.SIGCHLD, self._old_chld if self._old_chld is not None else signal.SIG_DFL)

    def wake(self) -> None:
        """End the current (or next) wait now. Any thread; never blocks."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._w, b"w")

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a wake-up; True if one came (and is consumed)."""
        try:
            ready, _, _ = select.select([self._r], [], [], max(timeout_s, 0.0))
        except (OSError, ValueError):  # closed under us: behave like a plain sleep's end
            return False
        if not ready:
            return False
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._r, 4096):
                pass
        self.wakeups += 1
        return True

    def close(self) -> None:
        """Uninstall (main thread) and close the pipe."""
        with contextlib.suppress(ValueError):  # not the main thread: leave the handlers
            self.uninstall()
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _child_exited(signum: int, frame: FrameType | None) -> None:
    # Nothing to do: the byte set_wakeup_fd wrote is the message; torch reaps the worker.
    return
