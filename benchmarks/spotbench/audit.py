"""The live replay's external audit: goodput and exactly-once from the workers' own trace.

Pure functions over the rows ``examples/train.py --trace`` appends (one per rank per
completed step: ``step``, ``epoch``, ``round``, ``rank``, ``pid``, ``time``, ``idx`` — that
rank's share — and ``global``, the step's whole global batch) and the replay's node
schedule. Nothing here reads what elasticd says about itself: the ledger
(``elasticd status --goodput``) is compared *against* this.

A step may have been attempted more than once (a restart from a checkpoint retrains the
steps after it); only its final attempt is in the model. Attempts are told apart by their
round where the launcher names one (elasticd), else by time: torchrun restarts every worker,
so two attempts of a step are at least a restart apart.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: Two rows of one step further apart than this (and with no round) are two attempts.
ATTEMPT_GAP_S = 1.0


def attempts(rows: Iterable[Mapping]) -> dict[int, list[list[Mapping]]]:
    """step -> its attempts, oldest first; each attempt is the rows of its ranks."""
    by_step: dict[int, list[Mapping]] = {}
    for r in rows:
        by_step.setdefault(int(r["step"]), []).append(r)
    out: dict[int, list[list[Mapping]]] = {}
    for step, rs in by_step.items():
        rs.sort(key=lambda r: float(r["time"]))
        groups: list[list[Mapping]] = []
        for r in rs:
            last = groups[-1][-1] if groups else None
            same = last is not None and (
                r.get("round") == last.get("round") if r.get("round") is not None
                else float(r["time"]) - float(last["time"]) <= ATTEMPT_GAP_S)
            if same:
                groups[-1].append(r)
            else:
                groups.append([r])
        out[step] = groups
    return out


def batch_hash(ids: Iterable[int]) -> str:
    """A step's ledger entry: the hash of the sample ids it trained (order-free)."""
    return hashlib.sha256(",".join(map(str, sorted(ids))).encode()).hexdigest()[:16]


@dataclass
class ExactlyOnce:
    """The exactly-once verdict of a run against its fault-free reference."""

    steps: int = 0                    # steps the run completed (0..steps-1)
    skipped: list[int] = field(default_factory=list)      # in the reference, never trained
    duplicated: list[int] = field(default_factory=list)   # a sample twice in a final attempt
    wrong: list[int] = field(default_factory=list)        # a final attempt's batch is not the reference's
    incomplete: int = 0               # final attempts with a rank's row missing (it died after the step)
    retrained_steps: int = 0          # steps with more than one attempt

    @property
    def ok(self) -> bool:
        return not (self.skipped or self.duplicated or self.wrong)


def exactly_once(rows: Sequence[Mapping], reference: Sequence[Mapping]) -> ExactlyOnce:
    """Compare every step's final attempt with the single-rank reference.

    A final attempt is right when every row names the reference's global batch and the
    ranks' shares, when all of them wrote their row, are that batch exactly (no sample
    twice, none missing). Steps are checked from 0 to the run's last step.
    """
    ref = {int(r["step"]): r for r in reference}
    got = attempts(rows)
    v = ExactlyOnce(steps=(max(got) + 1) if got else 0)
    v.retrained_steps = sum(1 for a in got.values() if len(a) > 1)
    for step in range(v.steps):
        if step not in got:
            v.skipped.append(step)
            continue
        final = got[step][-1]
        want = ref.get(step)
        if want is None:
            v.wrong.append(step)
            continue
        if any(list(r["global"]) != list(want["global"]) for r in final):
            v.wrong.append(step)
            continue
        shares = [i for r in final for i in r["idx"]]
        if len(shares) != len(set(shares)):
            v.duplicated.append(step)
        elif len(shares) < len(want["global"]):
            v.incomplete += 1
        elif batch_hash(shares) != batch_hash(want["global"]):
            v.wrong.append(step)
    return v


@dataclass(frozen=True)
class Audit:
    """Node-seconds of one replay, measured from outside (``t`` relative to the start)."""

    available: float        # node-seconds the trace made available (the nodes paid for)
    useful: float           # node-seconds that trained the final attempt of a step
    held: float             # worker-seconds of the job's world (the ledger's denominator)
    retrained_steps: int
    step_s: dict[int, float]  # the healthy step time at each world size

    @property
    def goodput(self) -> float:
        """Capacity goodput: useful / available (what the simulator predicts)."""
        return self.useful / self.available if self.available else 0.0

    @property
    def held_goodput(self) -> float:
        """Useful / the job's held worker-time (what ``status --goodput`` reports)."""
        return self.useful / self.held if self.held else 0.0


def available_node_s(changes: Sequence[tuple[float, int]], start_nodes: int, end_s: float) -> float:
    """The integral of the available node count over [0, end_s]; ``changes`` are
    ``(t, +1 | -1)`` as the replay applied them."""
    total, n, t = 0.0, start_nodes, 0.0
    for at, d in sorted(changes):
        at = min(max(at, 0.0), end_s)
        total += n * (at - t)
        n, t = n + d, at
    return total + n * (end_s - t)


def audit(rows: Sequence[Mapping], t0: float, changes: Sequence[tuple[float, int]],
          start_nodes: int, end_s: float) -> Audit:
    """Useful node-seconds = for every step's final attempt, its world size times the
    healthy step time at that size (the median interval between consecutive final steps
    at that size, measured on rank 0's rows). Held worker-seconds = the integral of the
    world size the job last trained at, from its first step to the end (a world that
    stalls still holds its workers)."""
    finals = _finals(rows, t0)
    gaps: dict[int, list[float]] = {}
    for (s0, a, w0), (s1, b, w1) in zip(finals, finals[1:], strict=False):
        if s1 == s0 + 1 and w0 == w1 and b > a:
            gaps.setdefault(w1, []).append(b - a)
    every = [g for v in gaps.values() for g in v]
    fallback = statistics.median(every) if every else 0.0
    step_s = {w: statistics.median(v) for w, v in gaps.items()}
    useful = 0.0
    for _step, at, w in finals:
        if 0.0 <= at <= end_s:
            useful += w * step_s.get(w, fallback)
    held = 0.0
    for (_s, a, w), (_s1, b, _w1) in zip(finals, [*finals[1:], (0, end_s, 0)], strict=False):
        lo, hi = max(a, 0.0), min(b, end_s)
        if hi > lo:
            held += w * (hi - lo)
    retrained = sum(1 for tries in attempts(rows).values() if len(tries) > 1)
    return Audit(available_node_s(changes, start_nodes, end_s), useful, held, retrained, step_s)


def _finals(rows: Sequence[Mapping], t0: float) -> list[tuple[int, float, int]]:
    """Every step's final attempt as (step, its lowest rank's row time - t0, world), by step."""
    out = []
    for step, tries in sorted(attempts(rows).items()):
        final = tries[-1]
        first = min(final, key=lambda r: int(r["rank"]))
        out.append((step, float(first["time"]) - t0, _world_of(final)))
    return out


def _pool_spans(changes: Sequence[tuple[float, int]], start_nodes: int,
                end_s: float) -> list[tuple[float, float]]:
    """The spans with nodes available: from the pool leaving zero (or the start, with nodes)
    to it reaching zero again (or ``end_s``)."""
    spans: list[tuple[float, float]] = []
    n, begun = start_nodes, (0.0 if start_nodes > 0 else None)
    for at, d in sorted(changes):
        if n == 0 and d > 0:
            begun = at
        n += d
        if n == 0 and begun is not None:
            spans.append((begun, at))
            begun = None
    if begun is not None:
        spans.append((begun, end_s))
    return spans


def _world_of(final: Sequence[Mapping]) -> int:
    """The world size of an attempt: as its rows say (older traces without ``world``: the
    highest rank that wrote a row, plus one — a lower bound)."""
    named = [int(r["world"]) for r in final if r.get("world") is not None]
    return max(named) if named else max((int(r["rank"]) for r in final), default=-1) + 1


@dataclass(frozen=True)
class Stretch:
    """One stretch of a replay with nodes available (from the pool leaving zero, or the
    start, to it reaching zero again, or the end), measured from the workers' rows."""

    start: float            # s after the replay's start
    end: float
    available: float        # node-seconds the trace made available in it
    useful: float           # node-seconds of final attempts in it, at the healthy step time
    steps: int              # final attempts in it
    first_step_s: float | None  # start -> the first step in it (None: it trained nothing)


def stretches(rows: Sequence[Mapping], t0: float, changes: Sequence[tuple[float, int]],
              start_nodes: int, end_s: float, step_s: Mapping[int, float]) -> list[Stretch]:
    """Where a replay's loss is, stretch by stretch: each cold start's cost shows as the
    first stretch's ``first_step_s``, and a stretch that ended before its first step
    (``first_step_s`` None) lost all of its ``available``. ``step_s`` is
    :attr:`Audit.step_s`."""
    finals = sorted((t, w) for _, t, w in _finals(rows, t0))
    fallback = statistics.median(step_s.values()) if step_s else 0.0
    out = []
    for a, b in _pool_spans(changes, start_nodes, end_s):
        inside = [(t, w) for t, w in finals if a <= t <= b]
        avail = (available_node_s(changes, start_nodes, b)
                 - available_node_s(changes, start_nodes, a))
        out.append(Stretch(a, b, avail, sum(w * step_s.get(w, fallback) for _, w in inside),
                           len(inside), inside[0][0] - a if inside else None))
    return out


@dataclass(frozen=True)
class Observed:
    """Per-event costs as the replay itself saw them (seconds), for a simulator run
    calibrated on this machine: what a cold start or a join costs when many launchers
    start at once on two cores differs from one start on a quiet machine."""

    cold_start_s: list[float]   # the pool came back from zero -> the first step
    join_s: list[float]         # an isolated arrival -> the first step at the larger world
    # A loss while the job trained, with no other change before the next step -> that
    # step. A kill only for a launcher that ignores notices (a noticed node left already).
    loss_s: list[float] = field(default_factory=list)


def observed_costs(rows: Sequence[Mapping], t0: float, changes: Sequence[tuple[float, int]],
                   start_nodes: int, quiet_s: float) -> Observed:
    """Cold starts: each time the available count left zero (or the replay began), to the
    next step any rank completed, if the pool did not drop to zero first. Joins: an arrival
    with no other change within ``quiet_s`` either side, while the job trained, to the first
    step at a world larger than the one before it. Losses: a loss within a second of a step,
    with no other change until the next step, to that step."""
    steps = sorted((float(r["time"]) - t0, int(r.get("world") or 0)) for r in rows if int(r["rank"]) == 0)
    times = [s for s, _ in steps]
    seq = sorted(changes)
    cold, joins = [], []
    for s, down in _pool_spans(changes, start_nodes, float("inf")):
        nxt = next((t for t in times if t > s), None)
        if nxt is not None and nxt < down:
            cold.append(nxt - s)
    for i, (at, d) in enumerate(seq):
        if d <= 0:
            continue
        near = [c for j, c in enumerate(seq) if j != i and abs(c[0] - at) < quiet_s]
        before = [w for s, w in steps if at - quiet_s < s <= at]
        if near or not before:
            continue
        after = next((s for s, w in steps if s > at and w > before[-1]), None)
        if after is not None and after - at < quiet_s:
            joins.append(after - at)
    losses = []
    for i, (at, d) in enumerate(seq):
        nxt = next((t for t in times if t > at), None)
        if d >= 0 or nxt is None or not any(at - 1.0 < t <= at for t in times):
            continue
        if not any(j != i and at < c[0] < nxt for j, c in enumerate(seq)):
            losses.append(nxt - at)
    return Observed(cold, joins, losses)
