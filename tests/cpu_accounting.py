"""Per-test CPU seconds (``pytest --cpu-durations=N``): what a test costs the machine.

Under load, a test's wall time says more about its neighbours than about the test; its CPU
seconds (user+sys of every process it ran: pytest itself, etcd, agents, workers) do not.
Most of that CPU reaches pytest through ``getrusage(RUSAGE_CHILDREN)``: a child's times
fold into its parent's when the parent reaps it. What does not is a process whose parent
died before it (a worker of a SIGKILLed agent is reparented to init, which reaps it): a
:class:`TreeSampler` reads pytest's descendants from /proc while the test runs, and
:func:`unreaped_cpu_s` adds, from those samples, the CPU of every process no tracked parent
reaped. Pure parts (:func:`unreaped_cpu_s`, :func:`cpu_table`) are unit-tested in
tests/unit/test_cpu_accounting.py; the conftest plugin wires them to pytest's hooks.

Limits: a process is charged to the test that reaps it (a module-scoped etcd to the test
whose teardown stops it); an orphan's last sample is at most one interval old, so up to
``interval_s`` of its CPU can be missed; the sampler's own /proc reads are charged to pytest.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from elasticd.process import descendants

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcSample:
    """One reading of /proc/<pid>/stat."""

    ppid: int
    own_s: float  # utime + stime
    reaped_s: float  # cutime + cstime: children this process reaped


@dataclass
class Track:
    """What the sampler saw of one process (keyed by pid and start time: pids are reused)."""

    first: ProcSample
    last: ProcSample
    born_during: bool  # not there at the test's first sample: its CPU so far is all the test's
    ended: int | None = None  # index of the first sample it was gone in; None: alive at the end


def unreaped_cpu_s(tracks: Mapping[tuple[int, int], Track], root_pid: int) -> float:
    """CPU seconds of sampled processes that no tracked, living parent reaped.

    A process whose parent is ``root_pid`` reaches ``RUSAGE_CHILDREN`` (pytest waits for
    what it starts); one whose parent is tracked and outlived it is in the parent's reaped
    times. Any other (its parent ended no later than it, or is not tracked: reparented to
    init) is counted here, from its baseline (zero if born during the test) to its last
    sample. A process alive at the end under a living parent is counted by whoever reaps it.

    Args:
        tracks: the sampler's tracks by (pid, start time).
        root_pid: the process whose own rusage counts its reaped children (pytest).
    """
    by_pid: dict[int, list[Track]] = {}
    for (pid, _start), track in tracks.items():
        by_pid.setdefault(pid, []).append(track)
    total = 0.0
    for track in tracks.values():
        ppid = track.last.ppid
        if ppid == root_pid:
            continue
        parents = by_pid.get(ppid, [])
        if parents and all(_outlived(p, track) for p in parents):
            continue
        base = 0.0 if track.born_during else track.first.own_s + track.first.reaped_s
        total += max(0.0, track.last.own_s + track.last.reaped_s - base)
    return total


def _outlived(parent: Track, child: Track) -> bool:
    """Whether ``parent`` was still there when ``child`` ended (so it reaped it, or will)."""
    if parent.ended is None:
        return True
    return child.ended is not None and child.ended < parent.ended


def read_sample(pid: int) -> tuple[int, ProcSample] | None:
    """(start time, sample) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    # Fields after the command's ")": state(0) ppid(1) ... utime(11) stime(12) cutime(13)
    # cstime(14) ... starttime(19).
    ticks = [int(f) for f in fields[11:15]]
    return int(fields[19]), ProcSample(int(fields[1]), (ticks[0] + ticks[1]) * _TICK_S,
                                       (ticks[2] + ticks[3]) * _TICK_S)


class TreeSampler:
    """Samples the descendants of ``root_pid`` (and every process seen so far) every
    ``interval_s`` on a thread of its own, from :meth:`start` to :meth:`stop`."""

    def __init__(self, root_pid: int, interval_s: float = 0.5) -> None:
        self.root_pid, self.interval_s = root_pid, interval_s
        self.tracks: dict[tuple[int, int], Track] = {}
        self._samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> dict[tuple[int, int], Track]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return self.tracks

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        index, self._samples = self._samples, self._samples + 1
        live = {pid for (pid, _s), t in self.tracks.items() if t.ended is None}
        seen: set[tuple[int, int]] = set()
        for pid in live.union(descendants(self.root_pid)):
            got = read_sample(pid)
            if got is None:
                continue
            key = (pid, got[0])
            seen.add(key)
            track = self.tracks.get(key)
            if track is None:
                self.tracks[key] = Track(got[1], got[1], born_during=index > 0)
            else:
                track.last = got[1]
        for key, track in self.tracks.items():
            if track.ended is None and key not in seen:
                track.ended = index


def rusage_s() -> float:
    """User+sys seconds of this process and of the children it reaped."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass(frozen=True)
class RunCost:
    """One test's wall and CPU seconds."""

    nodeid: str
    wall_s: float
    cpu_s: float


class CpuMeter:
    """Measures each test (setup, call, teardown) in turn: ``begin`` then ``end``.

    ``helpers`` names long-lived child processes that outlive tests and reap processes the
    tests start (the agent zygote, tests/elasticd_zygote.py): a test is charged what each
    used and reaped while it ran (the zygote's own CPU is charged to the test that started
    it)."""

    def __init__(self, interval_s: float = 0.5, helpers: Callable[[], list[int]] = list) -> None:
        self.interval_s = interval_s
        self.helpers = helpers
        self.costs: list[RunCost] = []
        self._open: tuple[str, float, float, TreeSampler, dict[int, float]] | None = None

    def begin(self, nodeid: str) -> None:
        sampler = TreeSampler(os.getpid(), self.interval_s)
        sampler.start()
        self._open = (nodeid, time.monotonic(), rusage_s(), sampler, self._helper_s())

    def end(self) -> RunCost:
        assert self._open is not None, "end() without begin()"
        nodeid, t0, cpu0, sampler, helpers0 = self._open
        self._open = None
        tracks = sampler.stop()
        helpers = sum(s - helpers0.get(pid, 0.0) for pid, s in self._helper_s().items())
        cost = RunCost(nodeid, time.monotonic() - t0,
                        rusage_s() - cpu0 + unreaped_cpu_s(tracks, sampler.root_pid) + helpers)
        self.costs.append(cost)
        return cost

    def _helper_s(self) -> dict[int, float]:
        out = {}
        for pid in self.helpers():
            got = read_sample(pid)
            if got is not None:
                out[pid] = got[1].own_s + got[1].reaped_s
        return out


def cpu_table(costs: Iterable[RunCost], top: int) -> list[str]:
    """The ``top`` tests by CPU seconds (all when ``top`` is 0), as lines for the terminal:
    CPU seconds, wall seconds, CPU/wall (cores kept busy), node id; then the totals."""
    ordered = sorted(costs, key=lambda c: c.cpu_s, reverse=True)
    shown = ordered if top == 0 else ordered[:top]
    lines = [f"{'cpu_s':>9} {'wall_s':>9} {'cores':>6}  test"]
    for c in shown:
        cores = c.cpu_s / c.wall_s if c.wall_s > 0 else 0.0
        lines.append(f"{c.cpu_s:9.2f} {c.wall_s:9.2f} {cores:6.2f}  {c.nodeid}")
    cpu, wall = sum(c.cpu_s for c in ordered), sum(c.wall_s for c in ordered)
    lines.append(f"{cpu:9.2f} {wall:9.2f} {cpu / wall if wall > 0 else 0.0:6.2f}  "
                 f"all {len(ordered)} tests")
    return lines
