"""The one-screen summary the agent prints when it gives up: the first failing rank (the
root cause), how it ended, its error and the last lines of its stderr log."""

from __future__ import annotations

import os
import signal
import stat
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import RunResult
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from elasticd.agent.supervision import Outcome


def first_failure(result: RunResult) -> tuple[int, str, int] | None:
    """(global rank, description, exit code) of the earliest failure in ``result``."""
    if not result.failures:
        return None
    rank, failure = min(result.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            what = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            what = f"killed by signal {-code}"
    else:
        what = f"exit code {code}"
    return rank, what, code


# What torch's ProcessFailure says when the worker left no error file: no information.
_NO_MESSAGE = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"


def _recorded(failure: ProcessFailure) -> tuple[str, str]:
    """(exception line, traceback) from torch's error file data, as far as it says.

    ``failure.message`` is a string, or (``ErrorHandler.record_exception``, which our
    launcher uses) ``{"message": "Name: text", "extraInfo": {"py_callstack": ...}}``.
    """
    msg = getattr(failure, "message", "")
    stack = ""
    if isinstance(msg, dict):
        extra = msg.get("extraInfo")
        stack = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
        msg = msg.get("message", "")
    if not isinstance(msg, str) or msg == _NO_MESSAGE:
        msg = ""
    return msg.strip(), stack if isinstance(stack, str) else ""


def failure_line(failure: ProcessFailure) -> str:
    """One plain line saying how a worker failed: its exception line
    (``ModuleNotFoundError: No module named 'x'``), else its exit code or signal. Pure."""
    line, _ = _recorded(failure)
    if line:
        return line.splitlines()[0][:500]
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def failure_summary(outcome: Outcome, tail_lines: int = 15,
                    read: Callable[[str], str] | None = None) -> str:
    """The one-screen summary printed when the agent gives up: plain lines (the error
    file's JSON is unpacked: its exception line and traceback, never the blob)."""
    lines = [f"elasticd: giving up: {outcome.reason}"]
    if outcome.failures:
        rank, failure = min(outcome.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
        code = failure.exitcode
        how = (f"signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        lines.append(f"first failure: rank {rank} (local rank {failure.local_rank}), {how}, "
                     f"pid {failure.pid}")
        msg, text = _recorded(failure)
        if msg:
            lines.append(f"error: {msg[:2000]}")
        stderr_log = _stderr_log_of(failure)
        if stderr_log:
            text = text or (read or _read)(stderr_log)
            lines.append(f"stderr log: {stderr_log}")
        if text:
            tail = text.strip().splitlines()[-tail_lines:]
            lines.append("last lines:")
            lines.extend(f"  {ln}" for ln in tail)
    return "\n".join(lines)


def _read(path: str) -> str:
    # Never through a symlink, never a FIFO: under workers.user the rank directory is the
    # worker's (its error file), so it could plant either where stderr.log was.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        with os.fdopen(fd, errors="replace", closefd=False) as fh:
            return fh.read()[-20000:]
    except OSError:
        return ""
    finally:
        os.close(fd)


def _stderr_log_of(failure: ProcessFailure) -> str:
    err = getattr(failure, "error_file", "") or ""
    # torch's DefaultLogsSpecs puts stderr.log next to error.json
    candidate = os.path.join(os.path.dirname(err), "stderr.log") if err else ""
    return candidate if candidate and os.path.exists(candidate) else ""


def print_summary(outcome: Outcome) -> None:
    sys.stderr.write(failure_summary(outcome) + "\n")
