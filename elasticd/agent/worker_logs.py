"""Workers' stdout/stderr in the agent's output as JSON lines (``[logging] format = "json"``).

torch's agent redirects each worker's stdout and stderr into files under the worker log
dir and, with ``tee``, tails them into its own stdout/stderr with a ``[default0]:`` prefix
(``torch.distributed.elastic.multiprocessing.tail_log``). That prefix turns a JSON log into
a mixed one: ``journalctl -u elasticd -o cat | jq`` stops at the first worker line.

In JSON mode the agent keeps torch's redirects (the files stay where they were) and
replaces its tee: :class:`JsonTeeLogsSpecs` hands torch no file to tail and runs
:class:`WorkerLineTail` over the same files instead, which writes every line as one JSON
object on the agent's stderr (through structlog's per-stream lock, so lines never
interleave with the agent's own events):

- a plain line becomes ``{"event": "worker_output", "rank", "local_rank", "stream",
  "line", "job", "node", "level", "timestamp"}``;
- a line that is already a JSON object (the worker API's own events in JSON mode, e.g.
  ``checkpoint_saved``) is kept as it is, with ``rank``, ``local_rank``, ``stream`` (unless
  it has its own) and ``source: "worker"`` added, so ``jq 'select(.event == "checkpoint_saved")'`` finds it.

A line longer than :data:`MAX_LINE_CHARS` is cut (with ``truncated: true``): a worker
printing a megabyte without a newline must not hold the agent's memory.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TextIO

import structlog
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import LogsDest

from elasticd import boundedjson
from elasticd.sensitive import scrub

MAX_LINE_CHARS = 64 * 1024
_POLL_S = 0.1


@dataclass(frozen=True)
class TailedFile:
    """One worker stream to tail: its file and who wrote it."""

    path: str
    rank: int
    local_rank: int
    stream: str  # "stdout" | "stderr"


def wrap_line(line: str, f: TailedFile, *, job: str, node: str, now: float) -> dict[str, object]:
    """The JSON object for one worker line (without its newline). Pure.

    Args:
        line: the text the worker wrote.
        f: where it came from.
        job, node: the agent's job and node id.
        now: the time the agent read it (epoch seconds).

    Returns:
        A JSON-serialisable dict (see the module docstring).
    """
    truncated = len(line) > MAX_LINE_CHARS
    text = line[:MAX_LINE_CHARS]
    where = {"rank": f.rank, "local_rank": f.local_rank, "stream": f.stream}
    if text.startswith("{") and not truncated:
        try:
            parsed = boundedjson.loads(text, what="worker log line", max_bytes=4 * MAX_LINE_CHARS)
        except ValueError:  # not JSON, or nested too deep: forwarded as text
            parsed = None
        if isinstance(parsed, dict) and "event" in parsed:
            parsed.setdefault("job", job)
            parsed.setdefault("node", node)
            return {**where, **parsed, "source": "worker"}  # the worker's own fields win
    ts = datetime.fromtimestamp(now, tz=timezone.utc).isoformat().replace("+00:00", "Z")
    out: dict[str, object] = {"event": "worker_output", **where, "line": scrub(text, "line"),
                           "job": job, "node": node, "level": "info", "timestamp": ts}
    if truncated:
        out["truncated"] = True
    return out


class WorkerLineTail:
    """Tails worker files from one thread and writes each complete line as JSON.

    A partial last line (the worker is mid-write) waits for its newline; at :meth:`stop`
    (the workers are gone) whatever is left is written too.
    """

    def __init__(self, files: list[TailedFile], *, job: str, node: str,
                 out: TextIO) -> None:
        self._files = files
        self._job, self._node = job, node
        self._printer = structlog.PrintLogger(file=out)  # shares the stream's write lock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-log-tail", daemon=True)

    def start(self) -> WorkerLineTail:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is left in the files, then end the thread."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _emit(self, f: TailedFile, line: str) -> None:
        obj = wrap_line(line, f, job=self._job, node=self._node, now=time.time())
        self._printer.msg(json.dumps(obj, default=str))

    def _run(self) -> None:
        handles: dict[TailedFile, Any] = {}
        partial: dict[TailedFile, str] = {f: "" for f in self._files}
        try:
            while True:
                last = self._stop.is_set()  # read once more after stop: nothing is lost
                for f in self._files:
                    fh = handles.get(f)
                    if fh is None:
                        if not os.path.exists(f.path):
                            continue
                        fh = handles[f] = open(f.path, errors="replace")  # noqa: SIM115
                    chunk = fh.read()
                    if not chunk:
                        continue
                    lines = (partial[f] + chunk).split("\n")
                    partial[f] = lines.pop()
                    for line in lines:
                        self._emit(f, line)
                    if len(partial[f]) > MAX_LINE_CHARS:
                        self._emit(f, partial[f])
                        partial[f] = ""
                if last:
                    for f, rest in partial.items():
                        if rest:
                            self._emit(f, rest)
                    return
                self._stop.wait(_POLL_S)
        finally:
            for fh in handles.values():
                fh.close()


class JsonTeeLogsSpecs(DefaultLogsSpecs):
    """torch's ``DefaultLogsSpecs`` whose tee is a :class:`WorkerLineTail` (JSON lines).

    torch calls :meth:`reify` once per worker group it starts (every restart and
    re-formation); the previous group's tail is finished then (its workers are gone) and
    a new one starts over the new files. :meth:`close` ends the last one.
    """

    def __init__(self, log_dir: str, *, job: str, node: str, out: TextIO) -> None:
        from torch.distributed.elastic.multiprocessing import Std

        super().__init__(log_dir=log_dir, redirects=Std.ALL, tee=Std.ALL)
        self._job, self._node, self._out = job, node, out
        self._tail: WorkerLineTail | None = None
        self._lock = threading.Lock()

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        files: list[TailedFile] = []
        for local_rank, env in envs.items():
            rank = int(env.get("RANK", local_rank))
            for stream, tee in (("stdout", dest.tee_stdouts), ("stderr", dest.tee_stderrs)):
                path = tee.get(local_rank)
                if path and path != os.devnull:
                    files.append(TailedFile(path, rank, local_rank, stream))
        # torch tails nothing: the tee is ours.
        dest.tee_stdouts, dest.tee_stderrs = {}, {}
        with self._lock:
            old, self._tail = self._tail, WorkerLineTail(files, job=self._job, node=self._node,
                                                          out=self._out).start()
        if old is not None:
            old.stop()
        return dest

    def close(self) -> None:
        """Flush and stop the tail of the last worker group (idempotent)."""
        with self._lock:
            tail, self._tail = self._tail, None
        if tail is not None:
            tail.stop()
