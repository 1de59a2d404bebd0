"""The agent side of the control channel: the runtime directory and the socket server.

A private runtime directory (mode 0700) per agent, passed to workers as
``ELASTICD_CONTROL_DIR``, holds the drain/stopped/drainable markers (see the package
docstring) and ``control.sock``, served here. Every line is validated
(``elasticd.control.messages``) and the per-rank table is bounded by the node's local
world size, so no worker can grow the agent's memory or stop the commit path by sending
garbage.
"""

from __future__ import annotations

import os
import shutil
import socket
import socketserver
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from io import BufferedIOBase
from pathlib import Path

import structlog

from elasticd.control.api import (
    API_PREFIX,
    DONE_PREFIX,
    DRAIN_FILE,
    DRAINABLE_PREFIX,
    ENV_CONTROL_DIR,
    ENV_CONTROL_SOCKET,
    SOCKET_FILE,
    STOPPED_PREFIX,
    CommitOutcome,
)
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
    LiveRegistration,
    MessageError,
    OrderNotice,
    ParkedReport,
    Ping,
    Pong,
    ReformedReport,
    Reply,
    StepReport,
    StoppedReport,
    parse_request,
    serialise,
)
from elasticd.control.reform import OrderBoard, WorkerReports, read_stopped, write_atomic
from elasticd.records import CheckpointPointer

log = structlog.get_logger(__name__)

MAX_CONNECTIONS = 256  # a node has a few workers; each holds one connection
# Per connecting process (SO_PEERCRED pid): a worker holds one, its data-loader children
# their own; 256 idle connections from one process used to lock every worker out.
MAX_CONNECTIONS_PER_PROCESS = 8
# Per session (getsid of that pid): each worker starts in a session of its own and its
# forked children stay in it; 300 forked children of one worker used to take all 256 slots.
MAX_CONNECTIONS_PER_SESSION = 64


@dataclass
class RankProgress:
    """Latest progress report of one local worker."""

    step: int = -1
    epoch: int = 0
    samples_trained: int = 0
    updated_at: float = 0.0  # monotonic, agent clock
    rank: int = -1  # global rank
    loss: float | None = None  # the newest loss the worker reported (None: never)
    cadence: tuple[int, float, str] | None = None  # the automatic save cadence, if reported
    step_s: float = 0.0  # the worker's median seconds per step lately (0: not measured)


@dataclass
class ProgressBoard:
    """What the agent knows of its workers' progress (thread-safe), by local rank.

    Reports for a local rank outside ``[0, max_local_ranks)`` are rejected, so the table
    never holds more than one entry per local worker.
    """

    max_local_ranks: int = 1024
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_advance: float = 0.0  # monotonic time any rank last advanced its step
    first_advance: float = 0.0  # ... and first did, in this worker group

    def report(self, local_rank: int, step: int, epoch: int, samples: int, rank: int = -1,
               loss: float | None = None, cadence: tuple[int, float, str] | None = None,
               step_s: float = 0.0) -> bool:
        """Record one report. Returns False (and records nothing) for an out-of-range rank."""
        if not 0 <= local_rank < self.max_local_ranks:
            return False
        now = time.monotonic()
        with self.lock:
            p = self.ranks.setdefault(local_rank, RankProgress())
            if step > p.step:
                self.last_advance = now
                self.first_advance = self.first_advance or now
            p.step, p.epoch, p.samples_trained, p.updated_at, p.rank = step, epoch, samples, now, rank
            if loss is not None:
                p.loss = loss
            if cadence is not None:
                p.cadence = cadence
            p.step_s = step_s
        return True

    def reset(self) -> None:
        with self.lock:
            self.ranks.clear()
            self.last_advance = self.first_advance = 0.0

    def max_step(self) -> int:
        with self.lock:
            return max((p.step for p in self.ranks.values()), default=-1)

    def snapshot(self) -> dict[int, RankProgress]:
        with self.lock:
            return {r: RankProgress(p.step, p.epoch, p.samples_trained, p.updated_at, p.rank, p.loss,
                                    p.cadence, p.step_s)
                    for r, p in self.ranks.items()}


CommitHandler = Callable[[CommitRequest], tuple[CommitOutcome, str]]
CheckpointIoHandler = Callable[[CheckpointIo], None]
DivergenceHandler = Callable[[DivergenceReport], None]
LatestHandler = Callable[[], CheckpointPointer | None]


def _peer_pid(sock: socket.socket) -> int:
    """The connecting process's pid (``SO_PEERCRED``; 0 where the kernel does not say)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return 0
    return int(struct.unpack("3i", creds)[0])


def _session_of(pid: int) -> int:
    """The session id of ``pid`` (0 when it is unknown or the process is gone)."""
    try:
        return os.getsid(pid) if pid > 0 else 0
    except OSError:
        return 0


class ControlChannel:
    """Owns the runtime directory and the control socket server of one agent.

    Args:
        on_commit: called for each commit request; returns (outcome, reason). An
            exception counts as ``UNKNOWN`` (never as a refusal: see ``CommitOutcome``).
        base_dir: parent of the runtime directory (``tempfile``'s default, $TMPDIR or /tmp,
            if None).
        on_latest: returns the committed pointer; an exception answers ``ok: false``.
        max_local_ranks: progress reports are accepted for local ranks ``[0, this)``.
        directory: an existing private runtime directory to own (made before the agent
            imported torch, for its first standbys); a new one under ``base_dir`` if None.
        on_checkpoint_io: called (server thread; must not block) for each checkpoint save
            or load a worker reports (the agent's metrics); an exception is logged.
        on_divergence: called (server thread) for each rank that reports its replica
            fingerprint differed from the majority's (the event, the metric); an exception
            is logged. It may block for its own etcd deadline: divergences are rare.
    """

    def __init__(self, on_commit: CommitHandler | None = None, base_dir: str | None = None,
                 on_latest: LatestHandler | None = None, *, max_local_ranks: int = 1024,
                 directory: Path | None = None,
                 on_checkpoint_io: CheckpointIoHandler | None = None,
                 on_divergence: DivergenceHandler | None = None) -> None:
        self.dir = Path(directory) if directory is not None else Path(
            tempfile.mkdtemp(prefix="elasticd-", dir=base_dir))
        os.chmod(self.dir, 0o700)
        self.progress = ProgressBoard(max_local_ranks=max_local_ranks)
        self._on_commit = on_commit
        self._on_latest = on_latest
        self._on_checkpoint_io = on_checkpoint_io
        self._on_divergence = on_divergence
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._per_pid: dict[int | tuple[str, int], int] = {}  # pid, ("session", sid) -> held
        self._per_pid_lock = threading.Lock()
        self.rejected = 0  # invalid messages so far (tests, logs)
        # Called (server thread; must not block) on every ping and every live report: a
        # live worker that parked reports it, and the agent wakes its tick at once.
        self.on_ping: Callable[[], None] | None = None
        self.reports = WorkerReports()  # the live workers' latest reports (control.reform)
        self.orders = OrderBoard()  # the newest re-formation order's round, and waits on it

    @property
    def socket_path(self) -> str:
        return str(self.dir / SOCKET_FILE)

    def env(self) -> dict[str, str]:
        """Environment variables that point workers at this channel."""
        return {ENV_CONTROL_DIR: str(self.dir), ENV_CONTROL_SOCKET: self.socket_path}

    def start(self) -> ControlChannel:
        channel = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                pid = _peer_pid(self.request)
                sid = ("session", _session_of(pid))
                with channel._per_pid_lock:
                    held, in_session = channel._per_pid.get(pid, 0), channel._per_pid.get(sid, 0)
                    if held >= MAX_CONNECTIONS_PER_PROCESS:
                        log.warning("control_connection_refused", pid=pid,
                                    reason=f"process holds {held} connections already")
                        return
                    if in_session >= MAX_CONNECTIONS_PER_SESSION:
                        log.warning("control_connection_refused", pid=pid, session=sid[1],
                                    reason=f"its session holds {in_session} connections already")
                        return
                    channel._per_pid[pid] = held + 1
                    channel._per_pid[sid] = in_session + 1
                try:
                    if not channel._connections.acquire(blocking=False):
                        log.warning("control_connection_refused",
                                    reason=f"over {MAX_CONNECTIONS} connections")
                        return
                    try:
                        channel._serve(self.rfile, self.wfile)
                    finally:
                        channel._connections.release()
                finally:
                    with channel._per_pid_lock:
                        for holder in (pid, sid):
                            left = channel._per_pid[holder] - 1
                            if left:
                                channel._per_pid[holder] = left
                            else:
                                del channel._per_pid[holder]

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

        self._server = Server(self.socket_path, Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="control",
                                        kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        return self

    def _serve(self, rfile: BufferedIOBase, wfile: BufferedIOBase) -> None:
        """Answer one connection's lines until it closes (or sends an over-long line)."""
        while True:
            try:
                raw = rfile.readline(MAX_LINE_BYTES + 1)
            except ConnectionResetError:  # the worker went away mid-line (killed, drained)
                return
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                # The stream cannot be resynchronised inside an over-long line: answer and drop it.
                self._write(wfile, ErrorReply(f"line exceeds {MAX_LINE_BYTES} bytes; connection closed"))
                return
            reply = self.dispatch(raw)
            if reply is not None and not self._write(wfile, reply):
                return

    @staticmethod
    def _write(wfile: BufferedIOBase, reply: Reply) -> bool:
        try:
            wfile.write(serialise(reply))
            wfile.flush()
        except (OSError, MessageError):
            return False
        return True

    def dispatch(self, raw: bytes) -> Reply | None:
        """Validate one line and act on it; the reply to send (None for progress)."""
        try:
            msg = parse_request(raw)
        except MessageError as exc:
            self._reject(str(exc))
            if any(op in raw[:256] for op in (b'"progress"', b'"checkpoint_io"', b'"diverged"')):
                return None  # fire-and-forget: the client reads no reply to it
            return ErrorReply(str(exc), exc.request_id)
        if isinstance(msg, StepReport):
            cadence = ((msg.save_every, msg.save_interval_s, msg.cadence)
                       if msg.save_every else None)
            if not self.progress.report(msg.local_rank, msg.step, msg.epoch, msg.samples, msg.rank,
                                        msg.loss, cadence, msg.step_s):
                self._reject(f"local rank {msg.local_rank} is outside "
                             f"[0, {self.progress.max_local_ranks})")
            return None
        if isinstance(msg, CheckpointIo):
            self._checkpoint_io(msg)
            return None
        if isinstance(msg, DivergenceReport):
            self._divergence(msg)
            return None
        if isinstance(msg, CommitRequest):
            return self._commit(msg)
        if isinstance(msg, LatestRequest):
            return self._latest(msg)
        if isinstance(msg, AwaitOrder):  # blocks this connection's thread only
            return OrderNotice(round=self.orders.wait_newer(msg.after_round, msg.timeout_s), id=msg.id)
        if isinstance(msg, LiveRegistration | ParkedReport | ReformedReport):
            if msg.local_rank >= self.progress.max_local_ranks:
                self._reject(f"local rank {msg.local_rank} is outside "
                             f"[0, {self.progress.max_local_ranks})")
                return ErrorReply(f"local rank {msg.local_rank} is out of range", msg.id)
            self.reports.put(msg)
            if self.on_ping is not None:
                self.on_ping()
            return Pong(id=msg.id)
        assert isinstance(msg, Ping)
        if self.on_ping is not None:
            self.on_ping()
        return Pong(id=msg.id)

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        if self.rejected <= 10 or self.rejected % 1000 == 0:  # calm logs under a flood
            log.warning("control_message_rejected", reason=reason, rejected=self.rejected)

    def _checkpoint_io(self, msg: CheckpointIo) -> None:
        if self._on_checkpoint_io is None:
            return
        try:
            self._on_checkpoint_io(msg)
        except Exception as exc:  # noqa: BLE001 - a metrics bug must not stop the channel
            log.warning("checkpoint_io_not_recorded", error=repr(exc), kind=msg.kind.value)

    def _divergence(self, msg: DivergenceReport) -> None:
        log.warning("replica_divergence_reported", rank=msg.rank, step=msg.step, source=msg.source,
                    reason=msg.reason)
        if self._on_divergence is None:
            return
        try:
            self._on_divergence(msg)
        except Exception as exc:  # noqa: BLE001 - a recording bug must not stop the channel
            log.warning("replica_divergence_not_recorded", error=repr(exc), rank=msg.rank)

    def _commit(self, msg: CommitRequest) -> CommitReply:
        if self._on_commit is None:
            return CommitReply(CommitOutcome.COMMITTED, "no fence configured", msg.id)
        try:
            outcome, reason = self._on_commit(msg)
        except Exception as exc:  # noqa: BLE001 - an error is not an answer: UNKNOWN, never REFUSED
            log.warning("commit_request_failed", error=repr(exc), step=msg.step)
            outcome, reason = CommitOutcome.UNKNOWN, f"agent error: {exc!r}"[:1000]
        return CommitReply(outcome, reason[:1000], msg.id)

    def _latest(self, msg: LatestRequest) -> LatestReply:
        if self._on_latest is None:
            return LatestReply(ok=True, pointer=None, id=msg.id)
        try:
            return LatestReply(ok=True, pointer=self._on_latest(), id=msg.id)
        except Exception as exc:  # noqa: BLE001 - etcd down: the worker falls back to listing
            return LatestReply(ok=False, reason=repr(exc)[:1000], id=msg.id)

    # -- drain and stop markers ----------------------------------------------------------
    def request_drain(self, reason: str) -> None:
        write_atomic(self.dir / DRAIN_FILE, reason)

    def share_with(self, gid: int) -> None:
        """Let the workers of ``workers.user`` (primary group ``gid``) use this channel.

        The directory becomes ``root:<gid>`` mode 1770: the workers' group may enter it
        and create its markers (``done-``, ``stopped-``, ``drainable-``, ``api-``); the sticky bit
        keeps it from removing or renaming the agent's files (``drain``, ``park``,
        ``reform.json``), and the directory itself stays the agent's (no chmod, no
        rename). The agent writes only through :func:`~elasticd.control.reform.write_atomic`
        (``O_EXCL`` temporaries, ``rename``) and reads the workers' files as regular files
        only (``O_NOFOLLOW``), so a planted symlink never makes it write or read elsewhere.
        The socket is ``root:<gid>`` 0660: only that group connects. See docs/security.md.
        """
        os.chown(self.dir, -1, gid)
        os.chmod(self.dir, 0o1770)
        if os.path.exists(self.socket_path):
            os.chown(self.socket_path, -1, gid)
            os.chmod(self.socket_path, 0o660)

    def clear_round(self) -> None:
        """Forget per-round markers before starting a new worker group."""
        for prefix in (STOPPED_PREFIX, DRAINABLE_PREFIX, DONE_PREFIX, API_PREFIX):
            for p in self.dir.glob(prefix + "*"):
                p.unlink(missing_ok=True)
        self.progress.reset()

    def clear_drain(self) -> None:
        (self.dir / DRAIN_FILE).unlink(missing_ok=True)

    def stopped_markers(self) -> dict[int, StoppedReport]:
        """``stopped-<rank>`` reports of workers that exited for a drain (or a live fallback)."""
        return read_stopped(self.dir)

    def done_count(self) -> int:
        """How many workers of the current group wrote ``done-<rank>`` (script returned, 0)."""
        return sum(1 for _ in self.dir.glob(DONE_PREFIX + "*"))

    def workers_on_api(self) -> bool:
        """True once a worker of the current group called the worker API's ``init`` (``api-<rank>``)."""
        return any(self.dir.glob(API_PREFIX + "*"))

    def workers_drainable(self) -> bool:
        """True once a worker of the current group called ``should_stop`` (``drainable-<rank>``)."""
        return any(self.dir.glob(DRAINABLE_PREFIX + "*"))

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        shutil.rmtree(self.dir, ignore_errors=True)
