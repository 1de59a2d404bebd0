"""The per-node control channel between an agent and its workers.

A private runtime directory (mode 0700) per agent, passed to workers as
``ELASTICD_CONTROL_DIR``:

- ``drain``: exists once the agent asks the job to stop at the next step boundary. A
  worker checks it with one ``stat`` per step (``elasticd.worker.should_stop``), then all
  ranks agree through one tiny all-reduce, so every rank of every node stops after the
  same step.
- ``stopped-<rank>``: written by a worker that exits 0 because of a drain (its own node's
  or a peer's), with the last trained step. It tells the agent "stopped for a drain, the
  job is not finished", so a surviving node re-forms instead of declaring success.
- ``drainable-<rank>``: written by a worker the first time it calls ``should_stop`` (an
  empty file). It tells the agent "this worker group stops at a step boundary when asked",
  so a node joining mid-training is admitted through a drain (no step lost) rather than by
  killing the workers; workers that never call ``should_stop`` (plain torchrun scripts)
  are restarted at once, as before. Progress reports alone do not mean the script checks
  for a stop.
- ``done-<rank>``: written by the launcher (``elasticd.agent.worker_exec``) when the
  worker's script returned with status 0, just before the process ends. It tells the
  agent "this rank completed its work": an abort or a hang in torch's teardown after it
  is not a failure, and never makes the agent re-run a finished script.
- ``control.sock``: a Unix stream socket, JSON lines. Workers send
  ``{"op": "progress", ...}`` (no reply; feeds hang detection and status) and
  ``{"op": "commit", ...}`` (reply ``{"ok": bool, "reason": str}``: the fenced
  checkpoint commit, done by the agent because only it knows whether its round is
  still current) and ``{"op": "latest"}`` (reply ``{"ok": true, "pointer": {...}|null}``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import socketserver
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

DRAIN_FILE = "drain"
SOCKET_FILE = "control.sock"
STOPPED_PREFIX = "stopped-"
DRAINABLE_PREFIX = "drainable-"
DONE_PREFIX = "done-"


@dataclass
class RankProgress:
    """Latest progress report of one local worker."""

    step: int = -1
    epoch: int = 0
    samples_trained: int = 0
    updated_at: float = 0.0  # monotonic, agent clock


@dataclass
class ProgressBoard:
    """What the agent knows of its workers' progress (thread-safe)."""

    ranks: dict[int, RankProgress] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_advance: float = 0.0  # monotonic time any rank last advanced its step
    first_advance: float = 0.0  # ... and first did, in this worker group

    def report(self, rank: int, step: int, epoch: int, samples: int) -> None:
        now = time.monotonic()
        with self.lock:
            p = self.ranks.setdefault(rank, RankProgress())
            if step > p.step:
                self.last_advance = now
                self.first_advance = self.first_advance or now
            p.step, p.epoch, p.samples_trained, p.updated_at = step, epoch, samples, now

    def reset(self) -> None:
        with self.lock:
            self.ranks.clear()
            self.last_advance = self.first_advance = 0.0

    def max_step(self) -> int:
        with self.lock:
            return max((p.step for p in self.ranks.values()), default=-1)

    def snapshot(self) -> dict[int, RankProgress]:
        with self.lock:
            return {r: RankProgress(p.step, p.epoch, p.samples_trained, p.updated_at)
                    for r, p in self.ranks.items()}


CommitHandler = Callable[[dict[str, Any]], tuple[bool, str]]
QueryHandler = Callable[[dict[str, Any]], dict[str, Any]]


class ControlChannel:
    """Owns the runtime directory and the control socket server of one agent.

    Args:
        on_commit: called for each ``commit`` request; returns (ok, reason).
        base_dir: parent of the runtime directory (``tempfile``'s default, $TMPDIR or /tmp,
            if None).
    """

    def __init__(self, on_commit: CommitHandler | None = None, base_dir: str | None = None,
                 on_latest: QueryHandler | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="elasticd-", dir=base_dir))
        os.chmod(self.dir, 0o700)
        self.progress = ProgressBoard()
        self._on_commit = on_commit
        self._on_latest = on_latest
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def socket_path(self) -> str:
        return str(self.dir / SOCKET_FILE)

    def env(self) -> dict[str, str]:
        """Environment variables that point workers at this channel."""
        return {"ELASTICD_CONTROL_DIR": str(self.dir), "ELASTICD_CONTROL_SOCKET": self.socket_path}

    def start(self) -> ControlChannel:
        channel = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for raw in self.rfile:
                    try:
                        msg = json.loads(raw)
                    except ValueError:
                        continue
                    reply = channel._dispatch(msg)
                    if reply is not None:
                        self.wfile.write(json.dumps(reply).encode() + b"\n")
                        self.wfile.flush()

        class Server(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

        self._server = Server(self.socket_path, Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="control",
                                        kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        return self

    def _dispatch(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        if op == "progress":
            self.progress.report(int(msg.get("rank", 0)), int(msg.get("step", -1)),
                                 int(msg.get("epoch", 0)), int(msg.get("samples", 0)))
            return None
        if op == "commit":
            if self._on_commit is None:
                return {"ok": True, "reason": "no fence configured"}
            try:
                ok, reason = self._on_commit(msg)
            except Exception as exc:  # a refused commit is safe; a crash here is not
                log.warning("commit_request_failed", error=str(exc))
                ok, reason = False, f"agent error: {exc}"
            return {"ok": ok, "reason": reason}
        if op == "latest":
            if self._on_latest is None:
                return {"ok": True, "pointer": None}
            try:
                return {"ok": True, **self._on_latest(msg)}
            except Exception as exc:  # etcd down: the worker falls back to listing
                return {"ok": False, "reason": str(exc)}
        if op == "ping":
            return {"ok": True}
        return {"ok": False, "reason": f"unknown op {op!r}"}

    # -- drain and stop markers ----------------------------------------------------------
    def request_drain(self, reason: str) -> None:
        tmp = self.dir / (DRAIN_FILE + ".tmp")
        tmp.write_text(reason)
        tmp.rename(self.dir / DRAIN_FILE)

    def drain_requested(self) -> bool:
        return (self.dir / DRAIN_FILE).exists()

    def clear_round(self) -> None:
        """Forget per-round markers before starting a new worker group."""
        for prefix in (STOPPED_PREFIX, DRAINABLE_PREFIX, DONE_PREFIX):
            for p in self.dir.glob(prefix + "*"):
                p.unlink(missing_ok=True)
        self.progress.reset()

    def clear_drain(self) -> None:
        (self.dir / DRAIN_FILE).unlink(missing_ok=True)

    def stopped_markers(self) -> dict[int, dict[str, Any]]:
        """``stopped-<rank>`` markers written by workers that exited for a drain."""
        out: dict[int, dict[str, Any]] = {}
        for p in self.dir.glob(STOPPED_PREFIX + "*"):
            try:
                out[int(p.name[len(STOPPED_PREFIX):])] = json.loads(p.read_text() or "{}")
            except (ValueError, OSError):
                continue
        return out

    def done_count(self) -> int:
        """How many workers of the current group wrote ``done-<rank>`` (script returned, 0)."""
        return sum(1 for _ in self.dir.glob(DONE_PREFIX + "*"))

    def workers_drainable(self) -> bool:
        """True once a worker of the current group called ``should_stop`` (``drainable-<rank>``)."""
        return any(self.dir.glob(DRAINABLE_PREFIX + "*"))

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        shutil.rmtree(self.dir, ignore_errors=True)


class ControlClient:
    """Worker side of the channel (used by ``elasticd.worker``). Never blocks training long."""

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self.path = socket_path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._file: Any = None
        self._backlog = b""  # the unsent tail of a progress line
        self._lock = threading.Lock()

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        sock.connect(self.path)
        self._sock, self._file = sock, sock.makefile("rb")

    def send(self, msg: dict[str, Any]) -> None:
        """Fire and forget (progress): never blocks training.

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
                data = json.dumps(msg).encode() + b"\n"
                self._backlog = data[self._send_nowait(data):]
            except OSError:
                self._close()

    def _send_nowait(self, data: bytes) -> int:
        assert self._sock is not None
        try:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send and wait for the reply.

        Raises:
            OSError: the agent did not answer within ``timeout_s``.
        """
        with self._lock:
            try:
                if self._sock is None:
                    self._connect()
                assert self._sock is not None and self._file is not None
                if self._backlog:  # finish a torn progress line first
                    self._sock.sendall(self._backlog)
                    self._backlog = b""
                self._sock.sendall(json.dumps(msg).encode() + b"\n")
                line = self._file.readline()
                if not line:
                    raise OSError("control socket closed by the agent")
                return dict(json.loads(line))
            except OSError:
                self._close()
                raise

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
