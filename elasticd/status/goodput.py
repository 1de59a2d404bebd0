"""The goodput ledger: of the worker-time a job held, how much trained new steps, and why
the rest did not. Pure: computed from the job's history record and its event history,
which the agents already keep bounded in etcd (``elasticd.history``, ``events/``).

How an interval is charged. Between two history samples ``a`` and ``b`` the job held
``a.world_size`` workers for ``b.t - a.t`` seconds (weight: worker-seconds; with the same
number of workers on every node that is node-time). The steps trained in it are
``b.step - a.step``, or, after a rollback (the step went back), the steps from the
checkpoint the job resumed from (``b.checkpoint_step``) to ``b.step``. Steps beyond the
highest step ever reached are *new*; the others are *retrained*. Each takes the time it
takes at the job's healthy rate at that world size (the workers' median time of a single
step at that size, which they measure and the samples carry; for records without it, the
median steps/s of the intervals at that size in which nothing happened: see
:func:`healthy_rates`), and the rest of the interval is lost, charged to
the cause of the events inside it, in this order: a replica divergence (a rank's state
differed from the majority's: its restore, or the restart from a checkpoint it caused)
is ``integrity``; a failure, a lost node, a restart or a
hang is ``recovery``; a drain, a notice or a leave is ``drain``; a join, a resize or a
re-formation is ``resize``; before the first step is ``startup``; with no event at all it
is ``stall`` (checkpoint stalls and slow steps). A gap longer than :data:`IDLE_INTERVALS`
sample intervals with no sample (no node published progress: the job was stopped, below
its minimum or down; the span ``elasticd status --plot`` shades "not training") is
``waiting``, weighted by the smaller world size on either side, but for the time from its
start to one sample interval past its last event, charged to that event's cause (a stop's
drain takes seconds, not the hours the job then stays stopped).

What this is not: an audit. Its resolution is the history's (5 s at first, coarser as the
job ages), the healthy rate is an estimate, and time while no node published anything is
seen only as a gap. The spot benchmark (benchmarks/spotbench/) measures goodput from the
outside; this ledger is what an operator can read at any time for any job.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from elasticd.etcd.client import EtcdClient
from elasticd.history import History, Sample
from elasticd.keys import JobKeys
from elasticd.records import Event, Progress, RecordError
from elasticd.status.snapshot import read_history

# The ledger's causes, in the order they are shown. "trained" is the goodput.
CAUSES = ("trained", "retrained", "startup", "integrity", "recovery", "resize", "drain", "waiting",
          "stall")
# A diverged replica (elasticd.worker.fingerprint): first, since the failure and restart
# that follow a divergence without a majority are its consequence, not a cause of their own.
INTEGRITY_KINDS = frozenset({"diverged"})
# "hung" and "straggler_ejected": the events of an ejection (elasticd.agent.elastic_agent).
RECOVERY_KINDS = frozenset({"failure", "lost", "lease_lost", "restart", "hang", "hung",
                            "rollback"})
DRAIN_KINDS = frozenset({"drain", "notice", "leave"})
RESIZE_KINDS = frozenset({"join", "resize", "reform", "round", "straggler_ejected"})
# Samples further apart than this many intervals: nobody trained in between (the agents
# write one every interval while a job trains; a stop or an outage writes none). One
# threshold for the ledger's "waiting" and the plot's "not training" span.
IDLE_INTERVALS = 2.5
DEFAULT_WINDOW_S = 3600.0


@dataclass(frozen=True)
class Ledger:
    """Worker-seconds by cause over ``[since, until]`` (Unix seconds)."""

    since: float
    until: float
    seconds: Mapping[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float | None:
        """The share of worker-time that trained new steps; None with no time at all."""
        total = self.total_s
        return self.seconds.get("trained", 0.0) / total if total > 0 else None

    def share(self, cause: str) -> float:
        total = self.total_s
        return self.seconds.get(cause, 0.0) / total if total > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"since": round(self.since, 3), "until": round(self.until, 3),
                "worker_seconds": round(self.total_s, 3),
                "goodput": None if self.goodput is None else round(self.goodput, 4),
                "by_cause": {c: {"worker_seconds": round(self.seconds.get(c, 0.0), 3),
                                 "share": round(self.share(c), 4)} for c in CAUSES}}


def monotonic(samples: Sequence[Sample]) -> list[Sample]:
    """The samples whose time is after every earlier one's (a stepped clock's are dropped)."""
    kept: list[Sample] = []
    for s in samples:
        if not kept or s.t > kept[-1].t:
            kept.append(s)
    return kept


def healthy_rates(samples: Sequence[Sample], events: Sequence[Event]) -> dict[int, float]:
    """Steps/s by world size. Where the workers measured their step time (a sample's
    ``step_s``, measured at the size of the sample before it, steps forward): one over the
    median of those, each itself the median of the workers' latest single steps. Other
    sizes (records of older agents, scripts that report no step time): the median rate
    of the intervals at that size (same size at both ends, steps forward) with no event
    inside them.

    Why single steps: a 5 s interval's rate averages in the checkpoint saves and slow
    steps inside it, so it took them for healthy time (never "stall"), and a short job
    has one or two clean intervals per size, whichever saves and start-ups they hold. The
    suite's live replay (tests/integration/agent/test_live_replay.py), where the outside
    audit counts the median single step as the healthy one, measured the ledger -17.4 to
    +9.4 points off it so; from the workers' step times, within 3 (docs/benchmarks.md)."""
    samples = monotonic(samples)
    times = sorted(e.time for e in events)
    rates: dict[int, list[float]] = {}
    measured: dict[int, list[float]] = {}
    for a, b in itertools.pairwise(samples):
        dt = b.t - a.t
        if dt <= 0 or b.step <= a.step or a.world_size <= 0:
            continue
        if b.step_s:
            measured.setdefault(a.world_size, []).append(b.step_s)
        if a.world_size != b.world_size or any(a.t < t <= b.t for t in times):
            continue
        rates.setdefault(a.world_size, []).append((b.step - a.step) / dt)
    out = {w: statistics.median(v) for w, v in rates.items()}
    out.update({w: 1.0 / statistics.median(v) for w, v in measured.items()})
    return out


def _cause(kinds: Iterable[str], *, started: bool) -> str:
    kinds = set(kinds)
    if kinds & INTEGRITY_KINDS:
        return "integrity"
    if kinds & RECOVERY_KINDS:
        return "recovery"
    if kinds & DRAIN_KINDS:
        return "drain"
    if kinds & RESIZE_KINDS:
        return "resize"
    return "stall" if started else "startup"


def rate_for(rates: Mapping[int, float], world: int) -> float | None:
    """Steps/s at ``world`` workers. With no clean interval at that size: the step time
    drawn through the two nearest measured sizes (how it changes with the world size is
    the job's own: faster with a fixed global batch on idle GPUs, slower where the
    all-reduce or the CPUs are the limit); with one measured size, its rate. Scaling one
    size's rate by the world size, as this once did, over-counted the rate of a size the
    job held only briefly, and so under-charged what it trained (the suite's live replay:
    7.7 points under the audit)."""
    if world in rates:
        return rates[world]
    if not rates:
        return None
    near = sorted(rates, key=lambda w: (abs(w - world), -w))[:2]
    if len(near) == 1:
        return rates[near[0]]
    w1, w2 = sorted(near)
    t1, t2 = 1.0 / rates[w1], 1.0 / rates[w2]
    step_s = t1 + (t2 - t1) * (world - w1) / (w2 - w1)
    # A line through two noisy points, extrapolated, can reach zero or below: the step time
    # is floored at half the faster of the two measured ones.
    return 1.0 / max(step_s, min(t1, t2) / 2)


def rolled_back_steps(event: Event) -> int:
    """The steps a ``rollback`` event says training went back (0 for any other event)."""
    steps = event.detail.get("steps") if event.kind == "rollback" else None
    return steps if isinstance(steps, int) and steps > 0 else 0


def rollback_losses(history: History, events: Sequence[Event]) -> tuple[int, float]:
    """The losses that sent the job back to older state, and the span they were seen over
    (seconds from the first history sample to the last): the checkpoint cadence's
    ``losses`` and ``observed_s`` (``checkpoint.cadence``). A loss is a ``rollback`` event,
    or a step back between two samples with no such event between them. Pure."""
    samples = monotonic(history.samples)
    if not samples:
        return 0, 0.0
    backs = [e.time for e in events if e.kind == "rollback"]
    unseen = sum(1 for a, b in itertools.pairwise(samples)
                 if b.step < a.step and not any(a.t < t <= b.t for t in backs))
    return len(backs) + unseen, samples[-1].t - samples[0].t


def idle_waiting_s(start: float, end: float, inner: Sequence[Event], interval_s: float) -> float:
    """Of a span with no sample (``start`` to ``end``, ``inner`` its events in time order),
    the seconds charged to ``waiting``: a quiet stretch before its first event, and each
    stretch after a drain, a notice or a leave (a stopped job, a node gone on purpose)
    but its first sample interval, which stays the event's. A stretch after a failure or
    a join stays the event's (a recovery or a resize that took long). Pure."""
    points = [(start, None), *((e.time, e.kind) for e in inner)]
    waited = 0.0
    for (t, kind), nxt in zip(points, [*(e.time for e in inner), end], strict=True):
        if kind is None:
            waited += nxt - t
        elif kind in DRAIN_KINDS:
            waited += max(0.0, nxt - t - interval_s)
    return waited


def compute(history: History, events: Sequence[Event], *, since: float | None = None,
            until: float | None = None) -> Ledger:
    """The ledger of the job between ``since`` and ``until`` (default: its whole history).

    An interval that straddles ``since`` is counted in proportion to its part inside.
    """
    samples = monotonic(history.samples)
    if len(samples) < 2:
        t = samples[0].t if samples else 0.0
        return Ledger(since if since is not None else t, until if until is not None else t, {})
    lo = samples[0].t if since is None else since
    hi = samples[-1].t if until is None else until
    rates = healthy_rates(samples, events)
    by_time = sorted(events, key=lambda e: e.time)
    seconds = dict.fromkeys(CAUSES, 0.0)
    gap_s = IDLE_INTERVALS * history.interval_s
    best = samples[0].step
    started = samples[0].step > 0
    for a, b in itertools.pairwise(samples):
        dt = b.t - a.t
        inside = max(0.0, min(b.t, hi) - max(a.t, lo)) / dt  # the part inside the window
        rolled_back = b.step < a.step
        inner = [e for e in by_time if a.t < e.time <= b.t]
        base = (b.checkpoint_step or 0) if rolled_back else a.step
        # Steps run again after rollbacks the agents reported inside the interval (the
        # samples show only a net step; a visible step back is counted from its checkpoint).
        again = 0 if rolled_back else sum(rolled_back_steps(e) for e in inner)
        trained = max(0, b.step - base) + again
        new = max(0, b.step - max(best, base))
        redo = trained - new
        best = max(best, b.step)
        kinds = [e.kind for e in inner]
        if rolled_back:
            kinds.append("restart")
        if dt > gap_s:  # nobody published: the quiet part is waiting, the rest as below
            waited = idle_waiting_s(a.t, b.t, inner, history.interval_s)
            seconds["waiting"] += min(a.world_size, b.world_size) * waited * inside
            dt -= waited
        world = a.world_size if a.world_size > 0 else b.world_size
        rate = rate_for(rates, world)
        busy_new = new / rate if rate else 0.0
        busy_redo = redo / rate if rate else 0.0
        busy = busy_new + busy_redo
        if busy > dt:  # faster than the median: all of it trained
            busy_new, busy_redo = busy_new * dt / busy, busy_redo * dt / busy
            busy = dt
        w = world * inside
        seconds["trained"] += busy_new * w
        seconds["retrained"] += busy_redo * w
        seconds[_cause(kinds, started=started)] += (dt - busy) * w
        started = started or trained > 0
    return Ledger(lo, hi, seconds)


def with_open_tail(history: History, progress: Progress | None, *, now: float,
                   closed: bool) -> History:
    """The history with the time since its newest sample: samples are written only as
    workers report steps, so a job that is not training now (a restart or re-formation
    still under way) was charged nothing for it until it trained again (the suite's live
    replay under load: its ledger covered 15.6 s of a 36 s run, 91.6 % against the
    audit's 50.4 %). Pure.

    Added: the newest progress record, if newer than the newest sample (steps reported
    since), and, for a job that is not closed and has reported no step for longer than a
    gap (``IDLE_INTERVALS`` sample intervals), a sample at ``now`` with no new step, at the
    last world size. ``compute`` charges that span as any quiet one: to the events in it,
    else ``waiting``. A job still training is left as it is: its last seconds are charged
    when the next sample comes, as trained time.
    """
    samples = list(monotonic(history.samples))
    if not samples:
        return history
    last = samples[-1]
    if progress is not None and progress.updated_at > last.t and progress.step >= 0 \
            and progress.world_size > 0:
        last = Sample(progress.updated_at, progress.step, progress.world_size,
                      progress.samples_per_s, progress.round, last.loss, last.checkpoint_step, None)
        samples.append(last)
    if not closed and now - last.t > IDLE_INTERVALS * history.interval_s:
        samples.append(Sample(now, last.step, last.world_size, 0.0, last.round, last.loss,
                              last.checkpoint_step, None))
    return replace(history, samples=tuple(samples))


def life_and_window(history: History, events: Sequence[Event], *,
                    window_s: float = DEFAULT_WINDOW_S) -> tuple[Ledger, Ledger]:
    """The whole-life ledger and the one of the last ``window_s`` seconds of history."""
    life = compute(history, events)
    if not history.samples:
        return life, life
    end = history.samples[-1].t
    return life, compute(history, events, since=max(end - window_s, history.samples[0].t), until=end)


@dataclass(frozen=True)
class GoodputReport:
    """What ``elasticd status --goodput`` shows: the ledger of a job's life and window."""

    job: str
    life: Ledger
    window: Ledger
    interval_s: float
    window_s: float
    note: str | None = None  # why the ledger is empty or partial

    def to_dict(self) -> dict[str, object]:
        return {"schema": "elasticd.goodput/v1", "job": self.job, "interval_s": self.interval_s,
                "window_s": self.window_s, "life": self.life.to_dict(),
                "window": self.window.to_dict(), "note": self.note}


def read_events(client: EtcdClient, keys: JobKeys) -> list[Event]:
    """The job's bounded event history (a record that does not validate is skipped)."""
    kvs, _ = client.get_prefix(keys.events_prefix)
    events = []
    for kv in kvs:
        try:
            events.append(Event.from_json(kv.value))
        except (RecordError, ValueError, TypeError):
            continue  # validated like every record read from etcd
    return events


def read_report(client: EtcdClient, job: str, events: Sequence[Event], *,
                window_s: float, progress: Progress | None = None, closed: bool = True,
                now: float | None = None) -> GoodputReport:
    """Read a job's history from etcd and compute its goodput report over ``events``,
    up to ``now`` for a job that is not ``closed`` (``with_open_tail``).

    Raises:
        EtcdUnavailableError: etcd did not answer.
    """
    history, note = read_history(client, job)
    if now is not None:
        history = with_open_tail(history, progress, now=now, closed=closed)
    life, window = life_and_window(history, events, window_s=window_s)
    return GoodputReport(job, life, window, history.interval_s, window_s, note)


def render(report: GoodputReport) -> str:
    """The report as a table (``elasticd status --goodput``)."""
    life, window, window_s = report.life, report.window, report.window_s
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:5.1f}%"

    lines = [f"job {report.job}: goodput {pct(life.goodput)} of {life.total_s / 3600:.2f} worker-hours "
             f"(last {window_s / 60:g} min: {pct(window.goodput)})",
             f"  {'cause':<10} {'life':>7} {'window':>7}"]
    for c in CAUSES:
        lines.append(f"  {c:<10} {pct(life.share(c) if life.total_s else None):>7} "
                     f"{pct(window.share(c) if window.total_s else None):>7}")
    lines.append(f"  (share of worker-time, from the job's history at {report.interval_s:g} s "
                 "resolution; see docs/status.md)")
    return "\n".join(lines)
