"""Which node is a straggler: pure decisions over the step facts the nodes report.

Why: in synchronous data parallel training every rank finishes every step together (the
gradient all-reduce waits for the slowest), so the step cadence each node sees is the
same everywhere and names nobody. What differs is how much of a step each node spends
*working* rather than waiting in the collective for the others: the straggler never
waits. Each agent samples its workers' main-thread state in ``/proc`` on every tick
(``S``: waiting, anything else: working, stopped or in I/O: the node is holding the
step up) and publishes the working share of its recent wall time (``BusyShare``) in its
beat beside its seconds per step; ``own step time = step_s x busy_share`` is the time the
node itself needs for a step.

The coordinator keeps a :class:`StragglerWatch` of those own step times and flags a node
whose own step time was at least ``factor`` (1.25) times the median of the members' on at
least ``SLOW_SHARE`` (80 %) of its looks over a ``window_s`` (30 s) it has covered, the
newest look included. :func:`shrink_pays` says whether ejecting it would make
the job faster ((N-1)/N of the median rate beats the current rate), and
:func:`pick_ejection` whether the coordinator ejects one now. The ejection puts the node
on probation (``rdzv/probation/<node>``, on a lease of :func:`probation_s`), which its
agent reads as a drain: its workers stop at the next agreed step with everyone's and the
others re-form live without it; only if it has not left the round within
:func:`drain_bound_s` is the next round opened with cause ``member_slow`` (its workers
killed). It waits as a spare and is admitted again when the probation ends; flagged
again, its probation doubles (docs/failure-model.md, "Stragglers").

Re-admission is a trial. A spare trains nothing, so its own step time in this job can be
measured only by letting it train; what shortens the cost of a node that did not recover
is judging it, once back, on a shorter window (:func:`trial_window_s`: a third of the
window, at least two busy-share windows) until its own step time has been under the factor
for one whole window.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

DEFAULT_FACTOR = 1.25
DEFAULT_WINDOW_S = 30.0
# The share of a window's looks that must be slow. Not every look: one look that happened
# to measure a fast step (a slow node's busy share dips while it waits on its own I/O, or
# a look lands between stop cycles) would restart the whole window, and a node slow but
# noisy would never be flagged. 4 in 5 also flags a node slow since its start about 24 s
# in, so a 30 s window flags within 30 s of the slowdown (every look slow: 30.6-32.1 s).
SLOW_SHARE = 0.8
BUSY_WINDOW_S = 5.0  # an agent's working share is measured over this much wall time
# A re-admitted straggler is judged on a third of the window, but never on less than two
# busy-share windows: its first own step times after the admission still average the
# seconds it spent joining.
TRIAL_WINDOW_SHARE = 1 / 3
TRIAL_WINDOW_MIN_S = 2 * BUSY_WINDOW_S
_WAITING = "S"  # /proc state of a main thread blocked in a collective (or any sleep)


class BusyShare:
    """The share of recent wall time a node's workers worked (not waiting), per tick.

    Args:
        window_s: the wall time the share is measured over.
    """

    def __init__(self, window_s: float = BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self._looks: deque[tuple[float, bool]] = deque()

    def observe(self, states: Iterable[str], now: float) -> None:
        """One look at the workers' main-thread states (``/proc/<pid>/stat`` field 3);
        no state (no worker running) forgets what was seen."""
        letters = list(states)
        if not letters:
            self._looks.clear()
            return
        self._looks.append((now, any(s != _WAITING for s in letters)))
        while self._looks and now - self._looks[0][0] > self.window_s:
            self._looks.popleft()

    def share(self) -> float:
        """Working share in [0, 1] over the window (0.0 before two looks)."""
        if len(self._looks) < 2:
            return 0.0
        return sum(1 for _, busy in self._looks if busy) / len(self._looks)


def trial_window_s(window_s: float) -> float:
    """The window a straggler re-admitted after its probation is judged on until its own
    step time has been under the factor for a whole ``window_s``. Pure.

    Why: the window is long so that a healthy node's noise never ejects it; a node that
    was slow for a whole window already and comes back is on probation, and if it is still
    slow each second of the trial costs the job the straggler's pace. A third of the
    window flags it again ~3x sooner (30 s: 10 s), still with 4 in 5 looks slow.
    """
    return min(window_s, max(window_s * TRIAL_WINDOW_SHARE, TRIAL_WINDOW_MIN_S))


@dataclass(frozen=True)
class StragglerVerdict:
    """The nodes flagged (node -> own step time / the members' median), and why; and the
    re-admitted nodes whose trial ended in this look without a flag."""

    flagged: Mapping[str, float]
    reason: str
    trials_passed: frozenset[str] = frozenset()


def find_stragglers(own_step_s: Mapping[str, Iterable[tuple[float, float]]], *, now: float,
                    factor: float = DEFAULT_FACTOR, window_s: float = DEFAULT_WINDOW_S,
                    windows: Mapping[str, float] | None = None) -> StragglerVerdict:
    """Flag the members persistently slower than the median. Pure.

    Args:
        own_step_s: member -> its (seen at, own step time in seconds) samples, oldest
            first, on the deciding node's clock.
        now: the same clock.
        factor: a node is slow while its own step time is at least this many times the
            median of the members' (per look, over their newest samples).
        window_s: a node is flagged only when at least ``SLOW_SHARE`` of its samples of
            the last ``window_s`` were slow, its newest among them, *and* its samples cover
            that whole window.
        windows: member -> its own window, where it differs (a re-admitted straggler on
            trial: :func:`trial_window_s`).

    Returns:
        The flagged nodes with their ratio (their median over the window / the members'
        median), and a one-line reason. Fewer than three members flag nobody: with two,
        the median is no reference.
    """
    series = {n: [(t, s) for t, s in samples if s > 0] for n, samples in own_step_s.items()}
    if len(series) < 3:
        return StragglerVerdict({}, "fewer than three members: no median to compare with")
    # The reference of each sample time: the median of every member's sample nearest
    # before it (members report at different moments).
    flagged: dict[str, float] = {}
    for node, samples in series.items():
        window = (windows or {}).get(node, window_s)
        recent = [(t, s) for t, s in samples if now - t <= window]
        older = [t for t, _ in samples if now - t > window]
        if not recent or not older:
            continue  # the window is not covered yet
        ratios = []
        for t, s in recent:
            ref = _median_at(series, t)
            if ref is None or ref <= 0:
                break
            ratios.append(s / ref)
        if len(ratios) < len(recent) or ratios[-1] < factor:
            continue
        if sum(1 for r in ratios if r >= factor) >= SLOW_SHARE * len(ratios):
            flagged[node] = round(statistics.median(ratios), 3)
    share = f"{SLOW_SHARE:.0%} of"
    if not flagged:
        return StragglerVerdict({}, f"nobody was {factor:g}x slower than the median on {share} "
                                    f"the looks of {window_s:g}s")
    trials = windows or {}
    names = ", ".join(f"{n} {r:.2f}x" + (f" (on trial: {trials[n]:g}s)" if n in trials else "")
                      for n, r in sorted(flagged.items()))
    return StragglerVerdict(flagged, f"slower than the median on {share} the looks of "
                                     f"{window_s:g}s: {names}")


def _median_at(series: Mapping[str, list[tuple[float, float]]], t: float) -> float | None:
    latest = [next((s for at, s in reversed(samples) if at <= t), None) for samples in series.values()]
    values = [s for s in latest if s is not None]
    return statistics.median(values) if len(values) >= 3 else None


def shrink_pays(own_step_s: Mapping[str, float], straggler: str, *, min_nodes: int) -> bool:
    """Whether the job is faster without ``straggler``. Pure.

    Synchronous steps go at the pace of the slowest node: with N nodes the job trains N
    shares per ``max(own)``; without the straggler, N-1 shares per the max of the rest.
    The shrink pays when ``(N-1) / max(rest) > N / max(all)``, and never below
    ``min_nodes``.
    """
    n = len(own_step_s)
    rest = [s for node, s in own_step_s.items() if node != straggler]
    if straggler not in own_step_s or n - 1 < max(min_nodes, 1) or not rest or min(own_step_s.values()) <= 0:
        return False
    return (n - 1) / max(rest) > n / max(own_step_s.values())


DRAIN_BOUND_MIN_S = 5.0  # an ejected straggler's workers get at least this to stop at a step
DRAIN_BOUND_STEPS = 10  # ... or this many of its steps, whichever is longer
DRAIN_BOUND_MAX_S = 120.0


def drain_bound_s(step_s: float) -> float:
    """How long an ejected straggler's workers may take to stop at the next agreed step
    before the coordinator ejects it the hard way (its workers killed). Pure.

    ``should_stop`` agrees on the flags of the call before, so a drain takes about two
    steps (more with ``every=N``); ``step_s`` is the straggler's own step time (0:
    unknown)."""
    return min(max(DRAIN_BOUND_MIN_S, DRAIN_BOUND_STEPS * max(step_s, 0.0)), DRAIN_BOUND_MAX_S)


MAX_PROBATION_DOUBLINGS = 3  # the 4th and later ejections keep 8x the base probation


def probation_s(base_s: float, ejections: int) -> float:
    """How long a straggler ejected for the ``ejections``-th time waits: the base, doubled
    for each earlier ejection, at most 8x. Pure."""
    return base_s * 2 ** min(max(ejections - 1, 0), MAX_PROBATION_DOUBLINGS)


def pick_ejection(flagged: Mapping[str, float], own_step_s: Mapping[str, float], *,
                  min_nodes: int, size_ok: Callable[[int], bool]) -> tuple[str, str] | None:
    """The flagged straggler to eject now, and why, or None. Pure.

    Only the slowest flagged node, only while the job without it is faster
    (:func:`shrink_pays` over the members' latest own step times ``own_step_s``), never
    below ``min_nodes`` and only to a size ``size_ok`` accepts (the job's valid sizes).
    """
    if not flagged:
        return None
    node = max(flagged, key=lambda n: (flagged[n], n))
    n = len(own_step_s)
    if node not in own_step_s or not size_ok(n - 1):
        return None
    if not shrink_pays(own_step_s, node, min_nodes=min_nodes):
        return None
    return node, (f"own step time {flagged[node]:.2f}x the members' median; {n - 1} nodes "
                  f"train faster than {n}")


@dataclass
class StragglerWatch:
    """The coordinator's memory of the members' own step times in one round (its clock),
    and of the stragglers it ejected that are on trial once admitted again."""

    factor: float = DEFAULT_FACTOR
    window_s: float = DEFAULT_WINDOW_S
    round: int = -1
    samples: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    flagged: frozenset[str] = frozenset()
    # Ejected stragglers: judged on ``trial_window_s`` until their own step time has been
    # under the factor for a whole window of one round. node -> since when it has been
    # (None: no sample in this round yet; the first sets it one busy-share window ahead).
    on_trial: dict[str, float | None] = field(default_factory=dict)

    def put_on_trial(self, node: str) -> None:
        """``node`` was ejected as a straggler: once admitted again, judge it on the
        trial window."""
        self.on_trial[node] = None

    def observe(self, round_: int, members: Iterable[str], own_step_s: Mapping[str, float],
                now: float) -> StragglerVerdict:
        """Take in this look's own step times (member -> seconds; 0: unknown) and decide."""
        names = list(members)
        if round_ != self.round:
            self.round, self.samples = round_, {}
            self.on_trial = dict.fromkeys(self.on_trial)  # a trial restarts with the round
        for node in names:
            s = own_step_s.get(node, 0.0)
            if s > 0:
                q = self.samples.setdefault(node, deque())
                q.append((now, s))
                while len(q) > 2 and now - q[1][0] > self.window_s:
                    q.popleft()  # keep one sample older than the window: its coverage
        for node in list(self.samples):
            if node not in names:
                del self.samples[node]
        series = {n: list(q) for n, q in self.samples.items()}
        trial = trial_window_s(self.window_s)
        verdict = find_stragglers(series, now=now, factor=self.factor, window_s=self.window_s,
                                  windows={n: trial for n in self.on_trial if n in series})
        # A slow look restarts a trial's clock; a whole window since passes it. The clock
        # starts one busy-share window after the node's first look in the round: until
        # then every member's busy share still averages the time before the admission (the
        # others trained without it), so its ratio says nothing yet. With a window no
        # longer than the busy-share window, a still-slow node passed its trial on those
        # looks alone (seen with a 5 s window under load).
        ref = _median_at(series, now)
        for node, since in list(self.on_trial.items()):
            own = own_step_s.get(node, 0.0) if node in names else 0.0
            if own <= 0:
                continue
            if since is None:
                self.on_trial[node] = now + BUSY_WINDOW_S
            elif ref is not None and own / ref >= self.factor:
                self.on_trial[node] = max(now, since)
        passed = frozenset(n for n, since in self.on_trial.items()
                           if since is not None and now - since >= self.window_s
                           and n not in verdict.flagged)
        for node in passed:
            del self.on_trial[node]
        self.flagged = frozenset(verdict.flagged)
        return replace(verdict, trials_passed=passed) if passed else verdict

    def latest(self) -> dict[str, float]:
        """Each member's newest own step time in this round (seconds)."""
        return {n: q[-1][1] for n, q in self.samples.items() if q}
