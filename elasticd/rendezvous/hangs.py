"""Which node hangs the job: a pure decision over the per-step progress the nodes report.

Why: when one node's workers stop making progress while its agent is alive (a worker
SIGSTOPped, a GIL-holding loop, a collective stuck on that node), every other rank
blocks in its next collective, so "no progress" alone is true of *every* node and names
nobody; torch would wait out the collective timeout (30 min) and NCCL's watchdog 480 s.
The culprit differs in two facts the agents can know: its last reported step is behind
the others' (it stopped before finishing the step they finished), or, when the steps are
equal, its workers are not blocked waiting in a collective -- stopped (``T`` in
``/proc``) or busy on a CPU -- while the others' wait idle.

:func:`find_hung` is the decision; the agent that acts on it (a fenced ejection from the
round, a live shrink of the others, the culprit killing its workers and rejoining cold)
runs on the coordinator (``rendezvous/coordinator.py``, ``protocol.decide_coordination``):
every agent publishes its node's facts in its beat (``records.Beat``: newest step, the
workers' activity read from ``/proc`` by :class:`ProcActivity`, its recent step time),
the coordinator keeps them in a :class:`HangWatch` (when *it* saw each step advance) and
ejects the node :func:`find_hung` names by opening the next round with cause
``member_hung`` (a fenced write); the others re-form live without it, and its own agent
kills its workers and rejoins cold (docs/failure-model.md, "Hung node").
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

# A job is stalled once it made no progress for this many of its recent step times (and
# never sooner than the configured floor): a job with 10 s steps is not hung after 3 s.
STALL_STEPS = 5.0
# A worker that burned more than this share of one CPU between two looks is busy.
BUSY_CPU_SHARE = 0.5
# A busy node (rather than a stopped one) is named only after this many stall thresholds:
# one rank's legitimate work (an evaluation, a synchronous save) looks the same for a while.
BUSY_STALL_FACTOR = 10.0


class WorkerActivity(Enum):
    """What a node's workers do while the job makes no progress (from its agent)."""

    WAITING = "waiting"  # blocked, idle: in a collective, waiting for a peer
    STOPPED = "stopped"  # a worker is stopped (SIGSTOP, ``T`` in /proc/<pid>/stat)
    BUSY = "busy"  # a worker burns CPU without finishing its step (a GIL-holding loop)
    IO = "io"  # a worker sleeps in the kernel on I/O (``D``: a checkpoint to a slow disk)
    UNKNOWN = "unknown"  # not reported


@dataclass(frozen=True)
class NodeProgress:
    """One member's progress as its agent reports it."""

    step: int  # the newest step its workers finished (-1: none yet)
    # When the deciding agent *saw* that step reported (its own clock, never the reporter's:
    # clock skew must not decide an ejection).
    advanced_at: float
    activity: WorkerActivity = WorkerActivity.UNKNOWN


@dataclass(frozen=True)
class HangVerdict:
    """``node`` to eject (None: nobody), and why, in one line; ``stalled_s``: how long the
    job had made no progress when the verdict fell past the stall threshold (0: it had not)."""

    node: str | None
    reason: str
    stalled_s: float = 0.0


def find_hung(progress: Mapping[str, NodeProgress], *, now: float, stall_s: float,
              min_nodes: int = 1, busy_stall_s: float | None = None,
              blind_until: float = float("-inf")) -> HangVerdict:
    """Name the node that hangs the job, if the facts name exactly one. Pure.

    Args:
        progress: every member of the current round -> its progress.
        now: the same clock as ``advanced_at``.
        stall_s: how long the whole job must have made no progress (seconds; a few
            step times, far below the collective timeout).
        min_nodes: the job's minimum; an ejection never goes below it.
        busy_stall_s: how long a node whose workers are *busy* (on a CPU: a GIL-holding
            loop, or legitimate work on one rank such as an evaluation) must stall the
            job before it is named (default: ``stall_s``); a stopped worker or a node
            behind that waits is named after ``stall_s``.
        blind_until: until when (same clock) the coordinator could not see progress: the
            latest etcd trouble it saw. Progress reaches it through etcd, so a stall counts
            from then at the earliest. Soak seed 72005: after a 4.9 s etcd freeze the
            coordinator read the beats at once, before its own node's report was written
            again, took the freeze for 5 s without progress and ejected its own node; both
            members restarted and 9 steps were retrained from the checkpoint.

    Returns:
        The node and the reason; ``node`` is None when the job progresses, when it has
        not stalled for ``stall_s``, when the facts do not single one node out, or when
        ejecting it would leave fewer than ``min_nodes``.
    """
    if len(progress) < 2:
        return HangVerdict(None, "fewer than two members: nobody to tell apart")
    latest = max(max(p.advanced_at for p in progress.values()), blind_until)
    if now - latest < stall_s:
        return HangVerdict(None, "the job makes progress")
    stalled = now - latest
    if len(progress) - 1 < min_nodes:
        return HangVerdict(None, f"stalled {stalled:.1f}s, but ejecting a node would "
                           f"leave fewer than min_nodes={min_nodes}", stalled)
    io = sorted(n for n, p in progress.items() if p.activity is WorkerActivity.IO)
    if io:
        # Legitimately slow (a synchronous checkpoint to a slow disk): the hang timeout
        # decides, never an ejection that would throw that save away.
        return HangVerdict(None, f"no progress for {stalled:.1f}s, but {','.join(io)} "
                           "is in I/O: not ejecting", stalled)
    top = max(p.step for p in progress.values())
    behind = sorted(n for n, p in progress.items() if p.step < top)
    busy_s = stall_s if busy_stall_s is None else max(busy_stall_s, stall_s)
    if len(behind) == 1:
        node = behind[0]
        if progress[node].activity is WorkerActivity.BUSY and stalled < busy_s:
            return _busy(node, stalled, busy_s)
        return HangVerdict(node, f"no progress for {stalled:.1f}s; {node} is behind at step "
                           f"{progress[node].step} (the others finished {top})", stalled)
    if behind:
        return HangVerdict(None, f"no progress for {stalled:.1f}s; several nodes behind "
                           f"({','.join(behind)}): no single culprit", stalled)
    odd = sorted(n for n, p in progress.items()
                 if p.activity in (WorkerActivity.STOPPED, WorkerActivity.BUSY))
    waiting = [n for n, p in progress.items() if p.activity is WorkerActivity.WAITING]
    if len(odd) == 1 and len(waiting) == len(progress) - 1:
        node = odd[0]
        if progress[node].activity is WorkerActivity.BUSY and stalled < busy_s:
            return _busy(node, stalled, busy_s)
        return HangVerdict(node, f"no progress for {stalled:.1f}s at step {top}; {node}'s "
                           f"workers are {progress[node].activity.value} while the others wait", stalled)
    return HangVerdict(None, f"no progress for {stalled:.1f}s at step {top}; no single "
                       "node stands out (the hang timeout decides)", stalled)


def _busy(node: str, stalled_s: float, busy_s: float) -> HangVerdict:
    return HangVerdict(None, f"no progress for {stalled_s:.1f}s; {node}'s workers are busy "
                       f"while the others wait: named after {busy_s:.1f}s", stalled_s)


def stall_threshold(floor_s: float, step_times_s: Iterable[float]) -> float:
    """How long the job must make no progress before ``find_hung`` may name a node. Pure.

    ``STALL_STEPS`` times the median of the members' recent step times, and never less than
    ``floor_s`` (``rendezvous.hang_eject_s``). Nodes that reported no step time are left out.
    """
    times = [t for t in step_times_s if t > 0]
    return max(floor_s, STALL_STEPS * statistics.median(times)) if times else floor_s


def classify_activity(states: Iterable[str], cpu_s: float, wall_s: float) -> WorkerActivity:
    """What a node's workers do, from their ``/proc`` states and CPU time. Pure.

    Args:
        states: each worker's state letter (``/proc/<pid>/stat`` field 3) now.
        cpu_s: the CPU seconds the busiest worker used over the last ``wall_s``.
        wall_s: the time between the two looks (seconds).

    Returns:
        STOPPED if any worker is stopped (``T``/``t``), IO if any sleeps on I/O (``D``),
        BUSY if a worker used more than ``BUSY_CPU_SHARE`` of a CPU, else WAITING;
        UNKNOWN when there is no worker or no interval to judge.
    """
    letters = list(states)
    if not letters:
        return WorkerActivity.UNKNOWN
    if any(s in ("T", "t") for s in letters):
        return WorkerActivity.STOPPED
    if any(s == "D" for s in letters):
        return WorkerActivity.IO
    if wall_s <= 0:
        return WorkerActivity.UNKNOWN
    return WorkerActivity.BUSY if cpu_s / wall_s > BUSY_CPU_SHARE else WorkerActivity.WAITING


def _read_stat(pid: int, proc: str) -> tuple[str, float] | None:
    """(state letter, CPU seconds) of one process, or None if it is gone."""
    try:
        with open(f"{proc}/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = text[text.rfind(")") + 2:].split()
    if len(rest) < 13:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return rest[0], (int(rest[11]) + int(rest[12])) / ticks


class ProcActivity:
    """Samples a node's workers' activity from ``/proc`` (the agent's tick, thin).

    Args:
        proc: the proc file system's mount point (tests point it elsewhere).
    """

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._last: tuple[float, dict[int, float]] | None = None  # (at, pid -> CPU seconds)

    def states(self, pids: Iterable[int]) -> list[str]:
        """The workers' state letters now (a gone pid is left out)."""
        return [st[0] for pid in pids if (st := _read_stat(pid, self.proc)) is not None]

    def sample(self, pids: Iterable[int], now: float) -> WorkerActivity:
        """The workers' activity since the previous sample (``now``: monotonic seconds)."""
        stats = {pid: st for pid in pids if (st := _read_stat(pid, self.proc)) is not None}
        last, self._last = self._last, (now, {pid: st[1] for pid, st in stats.items()})
        if last is None:
            return classify_activity([st[0] for st in stats.values()], 0.0, 0.0)
        used = max((st[1] - last[1][pid] for pid, st in stats.items() if pid in last[1]), default=0.0)
        return classify_activity([st[0] for st in stats.values()], used, now - last[0])


@dataclass
class HangWatch:
    """The coordinator's memory of the members' progress in one round (its own clock).

    ``observe`` is fed the members' beats; a step is *seen* advancing when the coordinator
    reads it, never at the time the reporter wrote (clock skew must not decide an
    ejection). Ejection arms only once every member reported a step in the round: at a
    round's start a node importing torch or loading a checkpoint is slow, not hung.
    """

    round: int = -1
    seen: dict[str, NodeProgress] = field(default_factory=dict)
    step_s: dict[str, float] = field(default_factory=dict)

    def observe(self, round_: int, members: Iterable[str],
                beats: Mapping[str, tuple[int, int, WorkerActivity, float]], now: float) -> None:
        """Take in this look's beats: node -> (round, step, activity, step_s)."""
        names = list(members)
        if round_ != self.round:
            self.round, self.seen, self.step_s = round_, {}, {}
        for node in names:
            beat = beats.get(node)
            if beat is None or beat[0] != round_:
                continue
            _, step, activity, step_s = beat
            old = self.seen.get(node)
            advanced_at = now if old is None or step > old.step else old.advanced_at
            self.seen[node] = NodeProgress(step, advanced_at, activity)
            if step_s > 0:
                self.step_s[node] = step_s
        for node in list(self.seen):
            if node not in names:
                del self.seen[node]

    def armed(self, round_: int, members: Iterable[str]) -> bool:
        """Every member reported a step (>= 0) in ``round_``, the round last observed (the
        facts of an earlier round never judge the members of a newer one)."""
        return round_ == self.round and all(
            node in self.seen and self.seen[node].step >= 0 for node in members)

    def verdict(self, round_: int, members: Iterable[str], *, now: float, floor_s: float,
                min_nodes: int, blind_until: float = float("-inf")) -> HangVerdict:
        """``find_hung`` over the members of ``round_``, with ``stall_threshold``; None
        until armed. ``blind_until``: as for ``find_hung`` (the latest etcd trouble)."""
        names = list(members)
        if not self.armed(round_, names):
            return HangVerdict(None, "not every member reported a step in this round yet")
        stall = stall_threshold(floor_s, (self.step_s.get(n, 0.0) for n in names))
        return find_hung({n: self.seen[n] for n in names}, now=now, stall_s=stall,
                         min_nodes=min_nodes, busy_stall_s=BUSY_STALL_FACTOR * stall,
                         blind_until=blind_until)
