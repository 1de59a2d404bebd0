"""The replicated job's recovery plan as values: load when nobody holds a state, else
replicate the newest step from its first holder to every rank behind (or new)."""

from __future__ import annotations

import pytest

from elasticd.worker.recovery_plan import NO_STATE, Load, Replicate, plan_replication

pytestmark = pytest.mark.timeout(10)


def test_nobody_holding_a_state_loads_the_checkpoint():
    """A fresh start or a full restart: every rank reports NO_STATE, the plan is Load."""
    assert isinstance(plan_replication([NO_STATE, NO_STATE, NO_STATE]), Load)


def test_the_first_holder_of_the_newest_step_sends_to_every_rank_behind_or_new():
    """Survivors at 41 and 40 and a joiner: rank 1 (the first at 41) sends to 0 and 2."""
    assert plan_replication([40, 41, NO_STATE, 41]) == Replicate(41, 1, (0, 2))


def test_ranks_that_agree_move_nothing():
    """All ranks at the same step: the source is rank 0 and nobody is behind."""
    assert plan_replication([7, 7]) == Replicate(7, 0, ())


def test_a_fresh_survivor_before_its_first_step_still_counts_as_holding():
    """A rank that loaded a checkpoint and trained nothing yet reports -1, not NO_STATE:
    it holds the loaded state and sends it to a joiner."""
    assert plan_replication([-1, NO_STATE]) == Replicate(-1, 0, (1,))


def test_an_empty_group_is_refused():
    """No report at all is a bug, not a plan."""
    with pytest.raises(ValueError, match="no rank"):
        plan_replication([])
