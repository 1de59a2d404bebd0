"""Pure policy of HSDP live re-formation (elasticd.worker.sharded.plan_shard_transfer):
who keeps its shards, who receives which shard from whom, and when the job must take
the restart path instead (with the reason it logs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticd.worker.sharded import NOT_HELD, RankShards, meta_skeleton, plan_shard_transfer

pytestmark = pytest.mark.timeout(30)


def held(step: int, size: int, coord: int) -> RankShards:
    return RankShards(step=step, shard_size=size, coordinate=coord)


NEW = RankShards(step=NOT_HELD, shard_size=0, coordinate=-1)


def test_a_node_loss_keeps_every_survivor_and_moves_nothing():
    """2x2 -> 1x2: the survivors (same coordinates) keep their shards; no transfer."""
    plan = plan_shard_transfer([held(9, 2, 0), held(9, 2, 1)], 2, [0, 1])
    assert plan.fallback is None and plan.step == 9
    assert plan.keepers == {0, 1} and plan.transfers == ()


def test_a_joiner_receives_each_shard_from_the_rank_with_its_coordinate():
    """1x2 -> 2x2, joiner ranks 2 and 3: shard 0 from rank 0 to rank 2, shard 1 from 1 to 3."""
    plan = plan_shard_transfer([held(14, 2, 0), held(14, 2, 1), NEW, NEW], 2, [0, 1, 0, 1])
    assert plan.fallback is None and plan.keepers == {0, 1}
    assert plan.transfers == ((0, 0, (2,)), (1, 1, (3,)))


def test_a_rank_behind_receives_like_a_joiner():
    """A holder at an older step is not a source and receives the newest shard."""
    plan = plan_shard_transfer([held(14, 2, 0), held(14, 2, 1), held(13, 2, 0), held(14, 2, 1)],
                               2, [0, 1, 0, 1])
    assert plan.keepers == {0, 1, 3} and plan.transfers == ((0, 0, (2,)),)


def test_a_changed_shard_size_falls_back_and_says_why():
    """Nodes of 2 then a mesh of shard size 3 (another nproc): the restart path reshards."""
    plan = plan_shard_transfer([held(5, 2, 0), held(5, 2, 1), NEW], 3, [0, 1, 2])
    assert plan.fallback is not None and "shard size changes from 2 to 3" in plan.fallback


def test_a_shard_no_intact_replica_holds_falls_back_and_says_why():
    """A survivor whose shard coordinate moved cannot be a source: nobody holds shard 1."""
    plan = plan_shard_transfer([held(5, 2, 0), held(5, 2, 0), NEW, NEW], 2, [0, 1, 0, 1])
    assert plan.fallback is not None and "no intact replica holds shard 1" in plan.fallback


def test_nobody_holding_a_state_is_a_fresh_start():
    """Every rank new: nothing to keep or send (the caller loads the checkpoint)."""
    plan = plan_shard_transfer([NEW, NEW], 2, [0, 1])
    assert plan.step == NOT_HELD and plan.fallback is None and plan.transfers == ()


def test_the_meta_skeleton_holds_no_memory_and_the_same_structure():
    """The copy kept for re-applying parallelize is on meta, the original untouched."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    sk = meta_skeleton(model)
    assert [n for n, _ in sk.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p.is_meta for p in sk.parameters()) and all(b.is_meta for b in sk.buffers())
    assert all(isinstance(p, nn.Parameter) for p in sk.parameters())
    assert not any(p.is_meta for p in model.parameters())
    assert sk[0].weight.dtype == torch.float64
