"""How often to checkpoint: the Young–Daly interval from measured cost and observed losses.

Why: everything trained since the last checkpoint is retrained when every node goes at once
(no notice, no survivor). Checkpointing more often costs the loop its blocking time per
save; less often costs half an interval of work per loss. Young (1974) and Daly (2006):
the expected loss is smallest at ``sqrt(2 * C * M)`` for a save that blocks ``C`` seconds
and a mean time ``M`` between losses. elasticd's save is asynchronous, so ``C`` is the
blocking copy only (milliseconds), and the interval is further bounded by the write (saves
never overlap) and by an overhead cap (``C / interval <= max_overhead``).

A pure function: the caller measures ``C`` and the write time (``checkpoint_saved``'s
``blocked_s`` and ``write_s``) and counts losses over an observed span (the goodput
ledger's recovery events).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MAX_OVERHEAD = 0.01  # the loop may spend at most 1 % of its time blocked on saves
DEFAULT_MAX_INTERVAL_S = 3600.0  # never longer: a job with no loss yet still saves hourly


@dataclass(frozen=True)
class CadenceChoice:
    """The chosen interval and why (for ``status`` and the log)."""

    interval_s: float
    mtbf_s: float
    reason: str


def young_daly_interval(blocking_s: float, write_s: float, losses: int, observed_s: float, *,
                        max_overhead: float = DEFAULT_MAX_OVERHEAD,
                        max_interval_s: float = DEFAULT_MAX_INTERVAL_S) -> CadenceChoice:
    """The checkpoint interval that minimises expected lost work.

    Args:
        blocking_s: measured seconds a save blocks the training loop.
        write_s: measured seconds a save takes to be written (in the background).
        losses: losses that rolled the job back to its checkpoint over ``observed_s``.
        observed_s: the span the losses were counted over. With no loss yet, one is
            assumed over it (the estimate only grows as the job runs without losses).
        max_overhead: the most ``blocking_s / interval`` may be.
        max_interval_s: the longest interval chosen.

    Returns:
        ``max(sqrt(2 * blocking_s * MTBF), blocking_s / max_overhead, write_s)``, at most
        ``max_interval_s`` (unless the overhead cap needs longer), with its reason.

    Raises:
        ValueError: negative costs or span, or ``max_overhead`` not in (0, 1].
    """
    if min(blocking_s, write_s, observed_s) < 0 or losses < 0:
        raise ValueError("costs, losses and the observed span must be >= 0")
    if not 0 < max_overhead <= 1:
        raise ValueError(f"max_overhead must be in (0, 1], got {max_overhead}")
    mtbf = observed_s / max(losses, 1)
    optimum = math.sqrt(2.0 * blocking_s * mtbf)
    floor = max(blocking_s / max_overhead, write_s)
    if optimum >= floor:
        interval, why = min(optimum, max_interval_s), "Young–Daly sqrt(2 * blocking * MTBF)"
        if optimum > max_interval_s:
            why = f"capped at {max_interval_s:g} s"
    else:
        interval = floor
        why = (f"the {max_overhead:.0%} overhead cap" if blocking_s / max_overhead >= write_s
               else "the write time (saves never overlap)")
    interval = max(interval, floor)
    return CadenceChoice(interval, mtbf, f"{interval:.1f} s: {why} (blocking {blocking_s:.3g} s, "
                                         f"write {write_s:.3g} s, MTBF {mtbf:.0f} s from "
                                         f"{losses} loss(es) in {observed_s:.0f} s)")


def interval_steps(interval_s: float, step_time_s: float) -> int:
    """The interval in whole optimizer steps (at least 1)."""
    if step_time_s <= 0:
        return 1
    return max(1, round(interval_s / step_time_s))


# ``[checkpoint] every``: "auto", or a fixed number of steps between saves.
AUTO = "auto"
# With "auto", until a save has measured its cost (and steps their time): the script's own
# ``save_every`` (ElasticLoop's default 50 steps), so the first save comes soon and measures.
# With no loss observed yet, the span counts as at least this long: a job seconds old has
# not shown that it loses its nodes every few seconds.
MIN_LOSSLESS_SPAN_S = 600.0


@dataclass(frozen=True)
class SaveCadence:
    """Steps between saves as all ranks agreed them, the interval in seconds, and why."""

    every_steps: int
    interval_s: float
    reason: str


def parse_every(text: str | None) -> int | str | None:
    """``ELASTICD_CHECKPOINT_EVERY`` / ``[checkpoint] every`` as a worker reads it. Pure.

    Returns:
        ``"auto"``, a whole number of steps >= 1, or None (unset: the script decides).

    Raises:
        ValueError: anything else, naming the accepted forms.
    """
    if text is None or not text.strip():
        return None
    text = text.strip().lower()
    if text == AUTO:
        return AUTO
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ValueError(f"checkpoint every = {text!r}: must be \"auto\" or a whole number of "
                         "steps >= 1, e.g. every = \"auto\" or every = 200")
    return steps


def parse_losses(text: str | None) -> tuple[int, float] | None:
    """``ELASTICD_OBSERVED_LOSSES`` (``"<losses>/<observed seconds>"``, from the agent's
    goodput ledger); None when absent or malformed (the cadence then assumes one loss over
    the time it has seen itself). Pure."""
    if not text:
        return None
    losses, sep, span = text.partition("/")
    try:
        n, s = int(losses), float(span)
    except ValueError:
        return None
    return (n, s) if sep and n >= 0 and math.isfinite(s) and s >= 0 else None


def choose_save_every(*, blocking_s: float | None, write_s: float, step_time_s: float,
                      losses: int, observed_s: float, first_every: int,
                      max_overhead: float = DEFAULT_MAX_OVERHEAD) -> SaveCadence:
    """The automatic cadence in steps: Young–Daly over the measured save cost. Pure.

    Args:
        blocking_s: seconds the newest measured save blocked the loop; None before any
            save was measured (then ``first_every`` steps, so the first save measures).
        write_s: seconds it took to be written (0 where this rank does not write).
        step_time_s: the loop's measured seconds per step (0: not known yet).
        losses, observed_s: losses that rolled the job back to a checkpoint, and the span
            they were counted over (the goodput ledger's, plus this worker's own time);
            with no loss, at least ``MIN_LOSSLESS_SPAN_S``.
        first_every: steps between saves before a measurement exists.
        max_overhead: the most of the loop's time saves may block it.

    Returns:
        The steps between saves (>= 1), the interval in seconds and the reason.
    """
    if blocking_s is None or step_time_s <= 0:
        return SaveCadence(first_every, first_every * step_time_s,
                           f"every {first_every} steps until a save has measured its cost")
    if losses == 0:
        observed_s = max(observed_s, MIN_LOSSLESS_SPAN_S)
    choice = young_daly_interval(blocking_s, write_s, losses, observed_s, max_overhead=max_overhead)
    steps = max(1, math.ceil(choice.interval_s / step_time_s))  # up: never over the cap
    return SaveCadence(steps, steps * step_time_s, choice.reason)
