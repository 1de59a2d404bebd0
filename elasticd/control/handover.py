"""Becoming a worker: the hand-over message an agent writes to a process it started ahead.

A warm standby (``elasticd.agent.warm``) reads one JSON line on its stdin and becomes the
worker it describes: its environment, working directory, argv and log files. A hot
spare's standby gets two lines. The first (``"spare": true``) starts the training script
before the spare's round exists: the environment has no rank, world size or bootstrap
address, and ``ELASTICD_SPARE=1``; the script imports and builds its model, and the
worker API (``elasticd.worker.init``) waits at the first call that needs the round. The
second line, written when the spare is admitted, is the worker's full environment and its
log files; the worker API applies it (:func:`become`) and joins the round.

Both sides import this module: the agent writes (:func:`message`), the process reads
(:func:`read`, :func:`become`); neither imports the other's package.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import IO, Any

from elasticd.control.api import ENV_SPARE


def message(env: Mapping[str, str], *, argv: list[str] | None = None, cwd: str | None = None,
            stdout: str | None = None, stderr: str | None = None, spare: bool = False) -> bytes:
    """One hand-over line. Pure.

    Args:
        env: the process's whole new environment.
        argv: the launcher's argv (the first line only; the script already runs at the
            second).
        cwd: the working directory (the first line only).
        stdout, stderr: log files to append to (None: keep the current one).
        spare: start the script ahead of its round (``ELASTICD_SPARE=1`` is set).
    """
    doc: dict[str, Any] = {"env": {**env, ENV_SPARE: "1"} if spare else dict(env),
                           "stdout": stdout, "stderr": stderr}
    if argv is not None:
        doc["argv"] = argv
    if cwd is not None:
        doc["cwd"] = cwd
    if spare:
        doc["spare"] = True
    return json.dumps(doc).encode() + b"\n"


def read(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next hand-over line from ``stream``; None at its end (the agent discarded us)."""
    line = stream.readline()
    return json.loads(line) if line else None


def become(msg: Mapping[str, Any], *, keep_stdin: bool = False) -> None:
    """Take the message's environment, working directory and log files in this process.

    ``keep_stdin``: leave stdin open (a spare reads its second line from it); otherwise it
    becomes ``/dev/null``, as for any worker.
    """
    os.environ.clear()
    os.environ.update(msg["env"])
    if msg.get("cwd"):
        os.chdir(msg["cwd"])
    if not keep_stdin:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, msg.get("stdout")), (2, msg.get("stderr"))):
        if path:
            f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            os.dup2(f, fd)
            os.close(f)
