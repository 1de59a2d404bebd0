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
