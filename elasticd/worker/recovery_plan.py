"""Live re-formation's recovery decision for a replicated (DDP) job, as a value.

Every rank reports the newest step it completed (``NO_STATE``: it holds none); from the
same gathered list every rank computes the same plan: :class:`Load` when nobody holds a
state (a fresh start, or after a restart), else :class:`Replicate` from the first rank
that completed the newest step to every rank behind (none: all ranks already agree).
Pure, so it is tested as values (tests/unit/test_recovery_plan.py), the way the agent's
``policy.decide`` is. The sharded jobs' plans sit beside their mechanisms
(:func:`elasticd.worker.sharded.plan_shard_transfer`,
:func:`elasticd.worker.peer_reshard.plan_memory_reshard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NO_STATE = -2  # a rank's report: it holds no state (fresh, or behind a restart)


@dataclass(frozen=True)
class Load:
    """Nobody holds a state: every rank loads the newest checkpoint."""

    reason: str


@dataclass(frozen=True)
class Replicate:
    """``source`` completed ``step``, the newest; it sends its state to ``behind``."""

    step: int
    source: int
    behind: tuple[int, ...]  # empty: every rank holds ``step`` already


RecoveryPlan = Load | Replicate


def plan_replication(steps: Sequence[int]) -> RecoveryPlan:
    """The plan from every rank's newest completed step (by rank; ``NO_STATE``: none).

    Raises:
        ValueError: no report at all (an empty group cannot happen in a formed group).
    """
    if not steps:
        raise ValueError("no rank reported a step")
    newest = max(steps)
    if newest == NO_STATE:
        return Load("no rank holds a state")
    return Replicate(newest, steps.index(newest), tuple(r for r, s in enumerate(steps) if s != newest))
