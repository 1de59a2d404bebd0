"""`elasticd status`: is the job training, at what size and speed, what failed, when.

Reads straight from etcd (one range read per screen), so it works on any machine that
reaches etcd, even when every agent is down. Exit codes make it a health check::

    0  training at full size          3  job unknown (no keys under /elasticd/<job>/)
    1  degraded (see docs/status.md)  4  etcd unreachable within --timeout
    2  not training                   78 bad flags or config (EX_CONFIG)

Every non-zero exit prints one line on stderr saying why. ``--json`` prints the documented
versioned document (docs/status.md, elasticd/status/schema.json); ``--watch`` redraws from
an etcd watch until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import structlog

from elasticd.errors import EX_CONFIG, ConfigError, EtcdUnavailableError
from elasticd.etcd.client import NOSPACE_FIX, EtcdClient
from elasticd.logs import ensure_configured
from elasticd.sensitive import scrub_text
from elasticd.status import jsondoc
from elasticd.status.model import (
    DEFAULT_WINDOW_S,
    EXIT_ETCD_UNREACHABLE,
    EXIT_OK,
    EXIT_UNKNOWN_JOB,
    derive_status,
    status_line,
)
from elasticd.status.options import (
    DEFAULT_EVENTS,
    PROG,
    StatusOptions,
    add_etcd_connection_flags,
    make_client,
    options_from_args,
    unknown_job_message,
    unreachable_message,
)
from elasticd.status.output import emit_job, emit_job_list
from elasticd.status.render import DEFAULT_MAX_ROWS, printable
from elasticd.status.snapshot import read_all_jobs, read_job

log = structlog.get_logger(__name__)
EXIT_INTERNAL = 1  # docs/status.md: 1 is also "degraded"; the stderr line tells them apart

def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number), got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``status`` subcommand to an ``argparse`` subparsers object.

    Returns:
        The new parser (its ``func`` default is ``run``).
    """
    p = subparsers.add_parser(
        "status", help="show a job's state, nodes, progress and events",
        description="Show what an elasticd job is doing, read straight from etcd. "
                    "Exit codes: 0 training at full size, 1 degraded, 2 not training, "
                    "3 job unknown, 4 etcd unreachable, 78 bad flags.",
    )
    add_arguments(p)
    p.set_defaults(func=run)
    _exit_78_on_bad_flags(p)
    return p


def _exit_78_on_bad_flags(p: argparse.ArgumentParser) -> None:
    # argparse exits 2 on a bad flag, which a health check would read as "not training".
    def error(message: str) -> None:
        p.print_usage(sys.stderr)
        p.exit(EX_CONFIG, f"{p.prog}: error: {message}\n")

    p.error = error  # type: ignore[method-assign,assignment]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `elasticd status` (shared flag names with the other subcommands)."""
    p.add_argument("--job", metavar="NAME", help="job to show; without it, list all jobs")
    add_etcd_connection_flags(p, timeout_type=_positive_float)
    p.add_argument("--json", action="store_true",
                   help="print the versioned JSON document (docs/status.md) instead of tables")
    p.add_argument("--watch", action="store_true",
                   help="redraw on every change (etcd watch) until Ctrl-C; with --json, one "
                        "document per line")
    p.add_argument("--events", type=_non_negative_int, default=DEFAULT_EVENTS, metavar="N",
                   help=f"show the last N events (default {DEFAULT_EVENTS})")
    p.add_argument("--window", type=_positive_float, default=DEFAULT_WINDOW_S, metavar="SECONDS",
                   help="mention the job's last recovery for this long after it (information, "
                        f"not health: a job at full size exits 0) (default {DEFAULT_WINDOW_S:g})")
    p.add_argument("--max-rows", type=_non_negative_int, default=None, metavar="N",
                   help=f"node rows in the table, unhealthy first (default {DEFAULT_MAX_ROWS}; "
                        "0 = all)")
    p.add_argument("--goodput", action="store_true",
                   help="show the job's goodput ledger: the share of worker-time that trained "
                        "new steps, and the rest by cause, for its whole life and the last "
                        "--goodput-window seconds (with --json: the elasticd.goodput/v1 document)")
    p.add_argument("--goodput-window", type=_positive_float, default=3600.0, metavar="SECONDS",
                   help="the recent window of --goodput (default 3600)")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="draw the job's history (world size, steps/s, loss, events) into "
                        "FILE.png or FILE.svg; needs the [plot] extra (matplotlib)")


@dataclass
class _Io:
    out: IO[str]
    err: IO[str]
    now: Callable[[], float]
    json: bool = False  # set from the raw flag, so even a config error gets a JSON document
    one_line: bool = False  # --watch --json: one document per line
    endpoints: list[str] = field(default_factory=list)

    def fail(self, code: int, message: str, *, job: str | None = None) -> int:
        """One line on stderr; with --json also an error document on stdout."""
        message = scrub_text(printable(message))
        print(f"{PROG}: {message}", file=self.err, flush=True)
        if self.json:
            doc = jsondoc.error_document(code, message, job=job, endpoints=self.endpoints,
                                         now=self.now())
            print(jsondoc.dumps(doc, pretty=not self.one_line), file=self.out, flush=True)
        return code


def run(args: argparse.Namespace, *, out: IO[str] | None = None, err: IO[str] | None = None,
        now: Callable[[], float] = time.time, stop: threading.Event | None = None) -> int:
    """Run `elasticd status` with parsed ``args``; returns the exit code (never raises).

    Whatever goes wrong, the operator gets one line and an exit code, never a traceback:
    an unexpected error is reported as exit 1 with its type and message (records in etcd
    are untrusted input, and a health check must not read a Python dump as an answer).

    Args:
        args: the namespace from the parser built by ``add_parser``.
        out, err: where to print (default: the process's stdout and stderr).
        now: clock for ages (tests pin it).
        stop: ends --watch when set (tests; people press Ctrl-C).
    """
    # stdout belongs to the answer (--json is parsed by scripts): logs go to stderr.
    ensure_configured()
    io = _Io(out or sys.stdout, err or sys.stderr, now, json=bool(getattr(args, "json", False)),
             one_line=bool(getattr(args, "watch", False)))
    try:
        return _run(args, io, now, stop)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_gone(io.out)
    except Exception as exc:  # the last line of defence: one line, never a traceback
        log.debug("status_failed", exc_info=True)
        return io.fail(EXIT_INTERNAL, f"internal error ({type(exc).__name__}: {exc}); "
                       "please report it with the output of `elasticd status --json`")


def _reader_gone(out: IO[str]) -> int:
    """The reader of our output went away (``elasticd status --json | head``): a normal
    end, exit 0, no message. The stream's descriptor is pointed at /dev/null, so the
    interpreter's last flush of what is still buffered does not raise again at exit."""
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO)
        return EXIT_OK
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    return EXIT_OK


def _run(args: argparse.Namespace, io: _Io, now: Callable[[], float],
         stop: threading.Event | None) -> int:
    try:
        opts = options_from_args(args)
    except ConfigError as exc:
        return io.fail(EX_CONFIG, str(exc))
    io.endpoints = opts.endpoint_list
    try:
        client = make_client(opts)
    except ConfigError as exc:
        return io.fail(EX_CONFIG, str(exc), job=opts.job)
    try:
        if getattr(args, "plot", None):
            from elasticd.status.plot import run_plot  # matplotlib only when asked for

            return run_plot(client, opts, args.plot, out=io.out, fail=io.fail)
        if getattr(args, "goodput", False):
            return _run_goodput(client, opts, io, window_s=args.goodput_window)
        if opts.watch:
            from elasticd.status.watch import run_watch  # keeps one-shot startup lean

            return run_watch(client, opts, out=io.out, err=io.err, now=now, fail=io.fail, stop=stop)
        return _run_once(client, opts, io)
    except EtcdUnavailableError as exc:
        return io.fail(EXIT_ETCD_UNREACHABLE, unreachable_message(opts, exc), job=opts.job)
    except ConfigError as exc:
        return io.fail(EX_CONFIG, str(exc), job=opts.job)
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def _run_once(client: EtcdClient, opts: StatusOptions, io: _Io) -> int:
    if opts.job is None:
        snaps, revision = read_all_jobs(client)
        t = io.now()
        statuses = [derive_status(s, t, window_s=opts.window_s, events_limit=0) for s in snaps]
        emit_job_list(statuses, opts, io.out, revision=revision, now=t)
        _warn_alarms(client, io)
        return EXIT_OK
    snap = read_job(client, opts.job)
    if snap is None:
        return io.fail(EXIT_UNKNOWN_JOB, unknown_job_message(opts), job=opts.job)
    status = derive_status(snap, io.now(), window_s=opts.window_s, events_limit=opts.events)
    emit_job(status, opts, io.out)
    _warn_alarms(client, io)
    if status.exit_code != EXIT_OK:
        print(f"{PROG}: {printable(status_line(status))}", file=io.err, flush=True)
    return status.exit_code


def _run_goodput(client: EtcdClient, opts: StatusOptions, io: _Io, *, window_s: float) -> int:
    from elasticd.status import goodput

    if opts.job is None:
        raise ConfigError("--goodput reads one job: add --job NAME")
    if opts.watch:
        raise ConfigError("--goodput prints once: drop --watch")
    snap = read_job(client, opts.job)
    if snap is None:
        return io.fail(EXIT_UNKNOWN_JOB, unknown_job_message(opts), job=opts.job)
    report = goodput.read_report(client, opts.job, [e.event for e in snap.events],
                                 window_s=window_s, progress=snap.progress, closed=snap.closed,
                                 now=time.time())
    if io.json:
        print(jsondoc.dumps(report.to_dict(), pretty=True), file=io.out, flush=True)
    else:
        print(goodput.render(report), file=io.out, flush=True)
        if report.note:
            print(f"{PROG}: {report.note}", file=io.err, flush=True)
    return EXIT_OK


def _warn_alarms(client: EtcdClient, io: _Io) -> None:
    """Name etcd's NOSPACE (or CORRUPT) alarm on stderr: the job cannot write while it lasts."""
    try:
        alarms = client.alarms()
    except (ConfigError, EtcdUnavailableError):
        return  # a role without maintenance rights may not list alarms: not the job's state
    for alarm in alarms:
        fix = NOSPACE_FIX if alarm == "NOSPACE" else "see etcd's log and docs"
        print(f"{PROG}: etcd alarm {alarm} is active: {fix}", file=io.err, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone ``elasticd`` parser with only ``status`` (for ``python -m elasticd.status``)."""
    parser = argparse.ArgumentParser(prog="elasticd", allow_abbrev=False)
    _exit_78_on_bad_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m elasticd.status [flags]``: the same as ``elasticd status [flags]``."""
    args = build_parser().parse_args(["status", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


__all__ = ["add_arguments", "add_parser", "build_parser", "main", "run"]
