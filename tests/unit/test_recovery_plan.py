"""The recovery plans as values. Replicated: load when nobody holds a state, else replicate
the newest step from its first holder to every rank behind (or new). Sharded: load, re-mesh
with transfers from intact replicas, reshard in memory, or fall back saying why."""

from __future__ import annotations

import pytest

from elasticd.worker.recovery_plan import (
    NO_STATE,
    Fallback,
    Load,
    Remesh,
    Replicate,
    Reshard,
    ShardReport,
    plan_replication,
    plan_sharded,
)

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


# -- the sharded job: Remesh | Reshard | Load | Fallback from one gathered report each --------
def held(step: int, size: int, coord: int, old_rank: int = -1, old_world: int = 0, own: int = -1,
         replicas: tuple[tuple[int, int], ...] = (), committed: int = -1) -> ShardReport:
    return ShardReport(step, old_rank, old_world, size, coord, own, replicas, committed)


NEW = ShardReport(NO_STATE)


def test_sharded_nobody_holding_a_state_loads_the_checkpoint():
    """Every rank new (a fresh start or a full restart): Load, whatever the mesh."""
    assert isinstance(plan_sharded([NEW, NEW], 2, [0, 1]), Load)


def test_sharded_a_node_loss_at_the_same_shard_size_remeshes_and_moves_nothing():
    """HSDP 2x2 -> 1x2: the survivors keep their coordinates, so they keep their shards."""
    plan = plan_sharded([held(9, 2, 0), held(9, 2, 1)], 2, [0, 1])
    assert plan == Remesh(9, frozenset({0, 1}), ())


def test_sharded_joiners_and_ranks_behind_receive_from_an_intact_replica():
    """HSDP 1x2 -> 2x2 with rank 2 behind (13) and rank 3 new: rank 0 sends shard 0 to rank
    2, rank 1 sends shard 1 to rank 3; the newest step wins."""
    plan = plan_sharded([held(14, 2, 0), held(14, 2, 1), held(13, 2, 0), NEW], 2, [0, 1, 0, 1])
    assert plan == Remesh(14, frozenset({0, 1}), ((0, 0, (2,)), (1, 1, (3,))))


def test_sharded_a_join_that_changes_the_shard_size_reshards_the_live_shards():
    """FSDP2 world 2 -> 3 (nobody lost, both at step 7): Reshard from the live shards at 7,
    each old rank serving its own."""
    plan = plan_sharded([held(7, 2, 0, 0, 2, own=4), held(7, 2, 1, 1, 2, own=4), NEW], 3, [0, 1, 2])
    assert plan == Reshard(7, fresh=True, old_world=2, sources={0: 0, 1: 1})


def test_sharded_a_kill_reshards_from_the_peer_replicas_at_their_step():
    """FSDP2 world 3 -> 2, old rank 2 lost, its replica (step 8) held by old rank 0 which is
    now rank 1: every rank rolls back to 8, old rank 2's shards served by new rank 1."""
    reports = [held(9, 3, 1, 1, 3, own=8, replicas=((0, 8),)), held(9, 3, 0, 0, 3, own=8, replicas=((2, 8),))]
    plan = plan_sharded(reports, 2, [0, 1])
    assert plan == Reshard(8, fresh=False, old_world=3, sources={0: 1, 1: 0, 2: 1})


def test_sharded_a_rank_lost_without_a_replica_falls_back_saying_both_reasons():
    """FSDP2 world 2 -> 1 with no replica kept: Fallback naming the shard-size change and,
    with replicas off, that no peer-RAM replica is kept."""
    plan = plan_sharded([held(5, 2, 0, 0, 2)], 1, [0], replicas_kept=False)
    assert isinstance(plan, Fallback)
    assert "shard size changes from 2 to 1" in plan.reason and "peer_replica_every=0" in plan.reason
    kept = plan_sharded([held(5, 2, 0, 0, 2)], 1, [0])
    assert isinstance(kept, Fallback) and "no survivor holds a replica of rank 1" in kept.reason


def test_sharded_a_checkpoint_newer_than_the_replicas_falls_back_to_it():
    """Replicas of step 8, the job at 9, a checkpoint committed at 9: Fallback (it retrains less)."""
    reports = [held(9, 3, 1, 1, 3, own=8, replicas=((0, 8),), committed=9),
               held(9, 3, 0, 0, 3, own=8, replicas=((2, 8),))]
    plan = plan_sharded(reports, 2, [0, 1])
    assert isinstance(plan, Fallback) and "newer than the replicas" in plan.reason


def test_sharded_no_intact_replica_of_a_coordinate_tries_memory_first():
    """HSDP at the same shard size where no survivor keeps shard 1, but every old rank is
    here at the newest step: Reshard from the live shards rather than the checkpoint."""
    reports = [held(5, 2, 0, 0, 2), held(5, 2, 1, 1, 2), NEW]
    plan = plan_sharded(reports, 2, [1, 0, 0])
    assert plan == Reshard(5, fresh=True, old_world=2, sources={0: 0, 1: 1})
    lost = plan_sharded([held(5, 2, 0, 0, 2), NEW], 2, [1, 0])
    assert isinstance(lost, Fallback) and "no intact replica holds shard" in lost.reason


def test_sharded_reports_survive_the_all_gather_encoding_and_bad_input_is_refused():
    """encode/decode round-trips at a fixed length; an empty group, a coordinate list of the
    wrong length or a report of the wrong length is an error, not a plan."""
    r = held(17, 4, 3, 3, 4, own=16, replicas=((1, 16), (2, 16)), committed=15)
    assert ShardReport.decode(r.encode()) == r and len(r.encode()) == len(NEW.encode()) == ShardReport.LEN
    with pytest.raises(ValueError):
        ShardReport.decode(r.encode()[:-1])
    with pytest.raises(ValueError, match="no rank"):
        plan_sharded([], 2, [])
    with pytest.raises(ValueError, match="coordinates"):
        plan_sharded([NEW], 2, [0, 1])
