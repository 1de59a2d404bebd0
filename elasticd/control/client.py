"""The worker side of the control channel: a small client that never blocks training long.

Step reports are fire-and-forget (dropped, never queued, when the agent is not
reading); requests wait for their reply up to ``timeout_s`` and raise ``OSError`` when
none came, which callers treat as "unknown", never as "no".
"""

from __future__ import annotations

import dataclasses
import itertools
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from elasticd.control.messages import (
    MAX_LINE_BYTES,
    AwaitOrder,
    CheckpointIo,
    CommitReply,
    CommitRequest,
    DivergenceReport,
    ErrorReply,
    LatestReply,
    LatestRequest,
    LiveReport,
    MessageError,
    OrderNotice,
    Ping,
    Pong,
    Reply,
    StepReport,
    parse_reply,
    serialise,
)

# Replies a request may skip (errors about earlier torn lines) before giving up.
_MAX_SKIPPED_REPLIES = 16


class ControlClient:
    """Worker side of the channel (used by ``elasticd.worker``).

    Args:
        socket_path: the agent's ``control.sock`` (``ELASTICD_CONTROL_SOCKET``).
        timeout_s: how long a request waits for its reply.
    """

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self.path = socket_path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._file: Any = None
        self._backlog = b""  # the unsent tail of a progress line
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        sock.connect(self.path)
        self._sock, self._file = sock, sock.makefile("rb")

    def send(self, msg: StepReport | CheckpointIo | DivergenceReport) -> None:
        """Fire and forget (progress, checkpoint reports): never blocks training.

        If the agent is not reading (frozen, busy), the message is dropped rather than
        waiting; a line that went out only in part is completed on a later call, so the
        stream never carries a torn line. Errors are swallowed: the agent may be restarting.
        """
        with self._lock:
            try:
                if self._sock is None:
                    self._connect()
                assert self._sock is not None
                if self._backlog:
                    self._backlog = self._backlog[self._send_nowait(self._backlog):]
                    if self._backlog:
                        return  # still blocked: drop this report
                data = serialise(msg)
                self._backlog = data[self._send_nowait(data):]
            except OSError:
                self._close()

    def _send_nowait(self, data: bytes) -> int:
        assert self._sock is not None
        try:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def request(self, msg: CommitRequest | LatestRequest | Ping | LiveReport | AwaitOrder) -> Reply:
        """Send a request (its ``id`` is assigned here) and wait for its reply.

        Returns:
            The reply with the same id; an :class:`ErrorReply` if the agent rejected it.

        Raises:
            OSError: the agent did not answer within ``timeout_s``, closed the
                connection, or answered with an invalid line.
        """
        with self._lock:
            rid = next(self._ids)
            line = serialise(type(msg)(**{**vars(msg), "id": rid}))
            try:
                if self._sock is None:
                    self._connect()
                assert self._sock is not None and self._file is not None
                if self._backlog:  # finish a torn progress line first
                    self._sock.sendall(self._backlog)
                    self._backlog = b""
                self._sock.sendall(line)
                for _ in range(_MAX_SKIPPED_REPLIES):
                    raw = self._file.readline(MAX_LINE_BYTES + 1)
                    if not raw:
                        raise OSError("control socket closed by the agent")
                    try:
                        reply = parse_reply(raw)
                    except MessageError as exc:
                        raise OSError(f"invalid reply from the agent: {exc}") from exc
                    if reply.id == rid:
                        return reply
                raise OSError("no reply to this request from the agent")
            except OSError:
                self._close()
                raise

    def commit(self, req: CommitRequest) -> CommitReply | ErrorReply:
        """Ask for a fenced commit. Raises OSError when the agent did not answer."""
        reply = self.request(req)
        if not isinstance(reply, CommitReply | ErrorReply):
            raise OSError(f"unexpected reply {reply.op!r} to a commit")
        return reply

    def latest(self) -> LatestReply | ErrorReply:
        """Ask for the committed pointer. Raises OSError when the agent did not answer."""
        reply = self.request(LatestRequest())
        if not isinstance(reply, LatestReply | ErrorReply):
            raise OSError(f"unexpected reply {reply.op!r} to latest")
        return reply

    def report(self, msg: LiveReport) -> bool:
        """Tell the agent a live worker's state; True once it acknowledged it."""
        try:
            return isinstance(self.request(msg), Pong)
        except OSError:
            return False

    def await_order(self, after_round: int, timeout_s: float) -> int:
        """Wait (at most ``timeout_s``, which must be below this client's ``timeout_s``)
        until the agent published an order for a round after ``after_round``.

        Returns:
            The newest order's round (``<= after_round``: none yet, the wait timed out).

        Raises:
            OSError: the agent did not answer (it is gone or restarting).
        """
        reply = self.request(AwaitOrder(after_round=after_round, timeout_s=timeout_s))
        if not isinstance(reply, OrderNotice):
            raise OSError(f"unexpected reply {reply.op!r} to await_order")
        return reply.round

    def ping(self) -> bool:
        """True if the agent answered."""
        try:
            return isinstance(self.request(Ping()), Pong)
        except OSError:
            return False

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = self._file = None
        self._backlog = b""

    def close(self) -> None:
        with self._lock:
            self._close()


# A report's step time: the median over this many of the worker's latest steps, and none
# until this many were seen (a start's or a re-formation's first steps are slow; the
# median of 15 steps holds up to 7 such, or one checkpoint save among them).
STEP_TIMES_KEPT = 15
STEP_TIMES_LEAST = 5


class StepTimes:
    """The median seconds per step of a worker's latest steps, measured from when each
    step's report was offered (every step, before the throttle: the agent, which sees one
    report per 0.2 s, cannot). What the goodput ledger takes as the job's healthy step time
    (``elasticd.status.goodput``): a median of single steps, so the checkpoint saves and
    slow steps among them stay the ledger's "stall" instead of slowing the healthy rate.
    Pure memory, bounded."""

    def __init__(self, kept: int = STEP_TIMES_KEPT, least: int = STEP_TIMES_LEAST) -> None:
        self._per_step: deque[float] = deque(maxlen=kept)
        self.least = least
        self._last: tuple[int, float] | None = None  # (step, when it was offered)

    def observe(self, step: int, now: float) -> float:
        """``step`` completed at ``now``; returns the median seconds per step (0.0 while
        fewer than ``least`` steps were seen since the first, or since steps went back)."""
        last = self._last
        if last is not None and step > last[0] and now >= last[1]:
            self._per_step.append((now - last[1]) / (step - last[0]))
        elif last is not None and step < last[0]:
            self._per_step.clear()  # resumed from an older step: a new stretch of steps
        if last is None or step != last[0]:
            self._last = (step, now)
        return statistics.median(self._per_step) if len(self._per_step) >= self.least else 0.0


class LatestReport:
    """Step reports rate-limited without ever leaving the newest one unsent.

    Why: a report is one line the agent parses, so a job with millisecond steps is
    throttled; but a throttle that *drops* a report leaves the agent behind the worker's
    true step exactly when it matters: the step before the job stalls (a peer hung) is
    the last one ever reported, and hang detection names the node that is behind. So a
    report that comes too soon is kept (only the newest) and sent by a daemon thread once
    the interval has passed, while the training thread is blocked in its collective. Every
    report offered is timed (:class:`StepTimes`) and carries its ``step_s``.

    Args:
        send: sends one report without blocking (``ControlClient.send``).
        min_interval_s: the least time between two reports (a forced one aside).
        clock: monotonic seconds (tests).
    """

    def __init__(self, send: Callable[[StepReport], None], min_interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send, self.min_interval_s, self._clock = send, min_interval_s, clock
        self._cond = threading.Condition()
        self._pending: StepReport | None = None
        self._next_at = 0.0  # when the next report may go out
        self._thread: threading.Thread | None = None
        self._closed = False
        self._times = StepTimes()

    def offer(self, msg: StepReport, *, force: bool = False) -> None:
        """Send ``msg`` now if the interval has passed (or ``force``), else keep it as the
        one to send when it has (replacing an older kept one)."""
        with self._cond:
            if self._closed:
                return
            now = self._clock()
            step_s = self._times.observe(msg.step, now)
            if step_s > 0:
                msg = dataclasses.replace(msg, step_s=round(step_s, 6))
            if force or now >= self._next_at:
                self._pending = None
                self._next_at = now + self.min_interval_s
                self._send(msg)
                return
            self._pending = msg
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elasticd-progress",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._pending is None:
                    self._cond.wait()
                    continue
                delay = self._next_at - self._clock()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                msg, self._pending = self._pending, None
                self._next_at = self._clock() + self.min_interval_s
                self._send(msg)

    def close(self) -> None:
        """Send what is kept, stop the thread (a report after this is ignored)."""
        with self._cond:
            if self._pending is not None:
                self._send(self._pending)
                self._pending = None
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
