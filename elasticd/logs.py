"""structlog setup: JSON lines for journald and machines, readable lines on a terminal.

Every log line goes to stderr (stdout belongs to the commands' output, e.g. ``status
--json``). Bind job/node/round with ``structlog.contextvars.bind_contextvars`` or
``log.bind``; event names are past-tense facts (``rendezvous_completed``).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_configured = False


def configure_logging(fmt: str = "auto", *, level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog and the stdlib root logger once.

    Args:
        fmt: ``"json"``, ``"console"``, or ``"auto"`` (console on a TTY, JSON otherwise).
        level: minimum level name.
        stream: where lines go (stderr by default).
    """
    global _configured
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    lvl = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # torch elastic logs through the stdlib; keep its INFO chatter out, warnings in.
    logging.basicConfig(stream=stream, level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _configured = True


def ensure_configured() -> None:
    """Configure with defaults if nobody did (library use, e.g. under torchrun)."""
    if not _configured:
        configure_logging()
