"""`elasticd status --watch`: redraw from an etcd watch until Ctrl-C, never by polling etcd.

One range read answers first (so a dead etcd exits 4 at once; a job that does not exist
yet is waited for: a watch started before the job shows it as soon as its first agent
registers), then a ``PrefixWatch`` keeps a local mirror of the job's keys current; the screen is
re-derived from the mirror on every change. A one-second local tick only refreshes the
ages shown ("12s ago") from the mirror; it never reads etcd. If the watch stream breaks,
``PrefixWatch`` reconnects and resyncs on its own; meanwhile the screen says so and keeps
the last known state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import IO

from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from elasticd.etcd.client import KV, EtcdClient, WatchEvent
from elasticd.keys import ROOT, JobKeys, job_of_key
from elasticd.status import jsondoc
from elasticd.status.model import EXIT_OK, EXIT_UNKNOWN_JOB, JobStatus, derive_status
from elasticd.status.options import StatusOptions, unknown_job_message
from elasticd.status.output import emit_job, emit_job_list
from elasticd.status.plot import trend_line
from elasticd.status.render import (
    DEFAULT_MAX_ROWS,
    make_console,
    print_screen,
    render_job,
    render_job_list,
)
from elasticd.status.snapshot import parse_all_kvs, parse_job_kvs, read_prefix

TICK_S = 1.0  # refresh ages on screen this often (from the local mirror, not from etcd)
COALESCE_S = 0.1  # a burst of changes (a round forming) redraws once, not per key


def _wanted(key: str) -> bool:
    job = job_of_key(key)
    # The per-round c10d store churns during rendezvous and never shows on screen.
    return job is not None and not key.startswith(f"{ROOT}{job}/store/")


class PrefixMirror:
    """A thread-safe local copy of the status-relevant keys under a prefix.

    Fed by a ``PrefixWatch`` (``on_resync``/``on_events``); ``changed`` is set on every
    applied change so the drawing loop wakes without polling.
    """

    def __init__(self) -> None:
        self._kvs: dict[str, KV] = {}
        self._revision = 0
        self._lock = threading.Lock()
        self.changed = threading.Event()

    def on_resync(self, kvs: list[KV], revision: int) -> None:
        with self._lock:
            self._kvs = {kv.key: kv for kv in kvs if _wanted(kv.key)}
            self._revision = revision
        self.changed.set()

    def on_events(self, events: list[WatchEvent]) -> None:
        applied = False
        with self._lock:
            for ev in events:
                self._revision = max(self._revision, ev.mod_revision)
                if not _wanted(ev.key):
                    continue
                if ev.value is None:
                    self._kvs.pop(ev.key, None)
                else:
                    self._kvs[ev.key] = KV(ev.key, ev.value, ev.mod_revision, 0, 0)
                applied = True
        if applied:
            self.changed.set()

    def snapshot(self) -> tuple[list[KV], int]:
        with self._lock:
            return sorted(self._kvs.values(), key=lambda kv: kv.key), self._revision


class _Frames:
    """Builds what to show from the mirror: a job status, the job list, or 'job gone'."""

    def __init__(self, opts: StatusOptions, mirror: PrefixMirror, now: Callable[[], float]):
        self.opts, self.mirror, self.now = opts, mirror, now
        self.seen = False  # the job has had keys since the watch started

    def absent_line(self) -> str:
        """What to say while the job has no keys: not started yet, or gone."""
        assert self.opts.job is not None
        prefix = JobKeys(self.opts.job).prefix
        if self.seen:
            return f"job {self.opts.job}: no keys left under {prefix}"
        return f"waiting for job {self.opts.job} to start (no keys under {prefix} yet)"

    def job(self) -> tuple[JobStatus | None, int]:
        kvs, rev = self.mirror.snapshot()
        assert self.opts.job is not None
        if not kvs:
            return None, rev
        self.seen = True
        snap = parse_job_kvs(self.opts.job, kvs, rev)
        return derive_status(snap, self.now(), window_s=self.opts.window_s,
                             events_limit=self.opts.events), rev

    def trend(self) -> str:
        """Steps/s and loss from the job's history record, as sparklines ("" without one)."""
        key = JobKeys(self.opts.job or "").history if self.opts.job else None
        kv = next((kv for kv in self.mirror.snapshot()[0] if kv.key == key), None)
        return trend_line(kv.value) if kv is not None else ""

    def jobs(self) -> tuple[list[JobStatus], int]:
        kvs, rev = self.mirror.snapshot()
        t = self.now()
        return [derive_status(s, t, window_s=self.opts.window_s, events_limit=0)
                for s in parse_all_kvs(kvs, rev)], rev


def run_watch(client: EtcdClient, opts: StatusOptions, *, out: IO[str], err: IO[str],
              now: Callable[[], float], fail: Callable[..., int],
              stop: threading.Event | None = None) -> int:
    """Show the job (or job list) and redraw on every etcd change until Ctrl-C or ``stop``.

    Returns:
        0 when stopped (Ctrl-C is the normal way out of --watch). A job that does not
        exist yet is waited for (one line on ``err`` says so), not an error.

    Raises:
        EtcdUnavailableError: the first read failed (the caller exits 4). Later outages
            are ridden out by the watch's reconnects.
    """
    stop = stop or threading.Event()
    prefix = JobKeys(opts.job).prefix if opts.job else ROOT
    kvs, revision = read_prefix(client, prefix)
    mirror = PrefixMirror()
    mirror.on_resync(kvs, revision)
    frames = _Frames(opts, mirror, now)
    if opts.job and not kvs:
        print(f"elasticd status: {frames.absent_line()}; Ctrl-C to stop waiting",
              file=err, flush=True)
    watch = client.watch_prefix(prefix, mirror.on_events, mirror.on_resync, name="status-watch")
    # Wake the drawing loop at once when stop is set, instead of at its next tick.
    def wake_on_stop() -> None:
        stop.wait()
        mirror.changed.set()

    waker = threading.Thread(target=wake_on_stop, name="status-watch-stop", daemon=True)
    waker.start()
    try:
        if opts.json:
            _loop_json(frames, opts, out, stop)
        else:
            _loop_screen(frames, opts, out, stop, connected=watch.connected)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()  # ends the waker too
        watch.stop()
    return EXIT_OK


def _loop_json(frames: _Frames, opts: StatusOptions, out: IO[str], stop: threading.Event) -> None:
    """One compact document per line, printed on each change (ages do not trigger one)."""
    endpoints = opts.endpoint_list
    while not stop.is_set():
        if not frames.mirror.changed.wait(TICK_S) or stop.wait(COALESCE_S):
            continue
        frames.mirror.changed.clear()
        if opts.job:
            status, _ = frames.job()
            if status is None:
                if not frames.seen:
                    continue  # not started yet: the first document is the job's
                doc = jsondoc.error_document(EXIT_UNKNOWN_JOB, unknown_job_message(opts),
                                             job=opts.job, endpoints=endpoints, now=frames.now())
                print(jsondoc.dumps(doc, pretty=False), file=out, flush=True)
            else:
                emit_job(status, opts, out, pretty=False)
        else:
            statuses, rev = frames.jobs()
            emit_job_list(statuses, opts, out, revision=rev, now=frames.now(), pretty=False)


def _loop_screen(frames: _Frames, opts: StatusOptions, out: IO[str], stop: threading.Event,
                 *, connected: threading.Event) -> None:
    console = make_console(out)
    started = time.monotonic()

    def draw() -> RenderableType:
        parts: list[RenderableType] = []
        if not connected.is_set() and time.monotonic() - started > opts.timeout_s:
            parts.append(Text(f"etcd unreachable at {opts.endpoints}: reconnecting; "
                              "showing the last known state", style="bold red"))
        if opts.job:
            status, rev = frames.job()
            if status is None:
                parts.append(Text(frames.absent_line(), style="bold"))
            else:
                rows = opts.max_rows
                if rows is None:
                    # Fit the terminal: header ~12 lines, events table len+4 lines.
                    budget = console.size.height - 12 - (len(status.events) + 4)
                    rows = max(3, min(DEFAULT_MAX_ROWS, budget)) if console.is_terminal \
                        else DEFAULT_MAX_ROWS
                parts.append(render_job(status, max_rows=rows))
                trend = frames.trend()
                if trend:
                    parts.append(Text(trend))
        else:
            statuses, rev = frames.jobs()
            parts.append(render_job_list(statuses, frames.now()))
        stamp = datetime.fromtimestamp(frames.now(), timezone.utc).strftime("%H:%M:%S")
        parts.append(Text(f"watching revision {rev} · {stamp} UTC · Ctrl-C to quit", style="dim"))
        return Group(*parts)

    if console.is_terminal:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while not stop.is_set():
                frames.mirror.changed.clear()
                live.update(draw(), refresh=True)
                if frames.mirror.changed.wait(TICK_S):
                    stop.wait(COALESCE_S)
        return
    # Not a terminal (piped, logged): print a full screen per change, no cursor tricks.
    while not stop.is_set():
        frames.mirror.changed.clear()
        print_screen(console, draw())
        console.rule()
        while not stop.is_set() and not frames.mirror.changed.wait(TICK_S):
            pass  # a pipe gets a new screen per change only, not per tick
        stop.wait(COALESCE_S)
