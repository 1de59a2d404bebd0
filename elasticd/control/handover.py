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
(:func:`read` or :func:`parse`, :func:`become`); neither imports the other's package. A line
is a :class:`Handover` record, read through the validating codec (:mod:`elasticd.codec`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

from elasticd import codec
from elasticd.control.api import ENV_SPARE

# A whole environment fits: Linux caps a process's argv + environment at 2 MiB by default.
MAX_LINE_BYTES = 4 << 20


@dataclass(frozen=True)
class Handover:
    """One hand-over line.

    Attributes:
        env: the process's whole new environment.
        stdout, stderr: log files to append to (None: keep the current one).
        argv: the launcher's argv (the first line only; the script already runs at the second).
        cwd: the working directory (the first line only).
        spare: the script starts ahead of its round (``ELASTICD_SPARE=1`` is in ``env``).
    """

    env: dict[str, str]
    stdout: str | None = None
    stderr: str | None = None
    argv: list[str] | None = None
    cwd: str | None = None
    spare: bool = False


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
    record = Handover(env={**env, ENV_SPARE: "1"} if spare else dict(env), stdout=stdout,
                      stderr=stderr, argv=argv, cwd=cwd, spare=spare)
    return codec.dumps(record) + b"\n"


def parse(line: bytes | str) -> Handover:
    """One hand-over line, validated.

    Raises:
        codec.RecordDecodeError: not a hand-over line (names the field), or over 4 MiB.
    """
    return codec.decode(Handover, line, what="hand-over line", max_bytes=MAX_LINE_BYTES)


def read(stream: IO[bytes]) -> Handover | None:
    """The next hand-over line from ``stream``; None at its end (the agent discarded us).

    Raises:
        codec.RecordDecodeError: as :func:`parse`.
    """
    line = stream.readline(MAX_LINE_BYTES + 1)
    return parse(line) if line else None


def become(msg: Handover, *, keep_stdin: bool = False) -> None:
    """Take the message's environment, working directory and log files in this process.

    ``keep_stdin``: leave stdin open (a spare reads its second line from it); otherwise it
    becomes ``/dev/null``, as for any worker.
    """
    os.environ.clear()
    os.environ.update(msg.env)
    if msg.cwd:
        os.chdir(msg.cwd)
    if not keep_stdin:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, msg.stdout), (2, msg.stderr)):
        if path:
            f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            os.dup2(f, fd)
            os.close(f)
