"""The peer-RAM replica's pure policy: who holds whose replica, and when memory suffices."""

from __future__ import annotations

import pytest

from elasticd.worker.peer_replica import NO_HOLDER, held_by, plan_peer_recovery, ring_holders

pytestmark = pytest.mark.timeout(10)


def test_ring_holders_put_each_replica_on_the_next_node():
    """2 nodes x 2: rank r's replica sits on the other node at the same local index."""
    assert ring_holders(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert ring_holders(["a", "b", "c"]) == [1, 2, 0]
    assert ring_holders(["a", "a", "b"]) == [2, 2, 0]
    assert held_by([2, 2, 0], 2) == [0, 1]


def test_one_node_has_no_holder():
    """A single node cannot hold a replica off itself."""
    assert ring_holders(["a", "a"]) == [NO_HOLDER, NO_HOLDER]


def test_single_node_loss_recovers_from_the_holders():
    """Node b (ranks 2, 3) lost: ranks 0, 1 serve their own shards and b's replicas."""
    plan = plan_peer_recovery([2, 3, 0, 1], frozenset({2, 3}), {0: 10, 1: 10}, {2: 10, 3: 10})
    assert plan.fallback is None and plan.step == 10
    assert dict(plan.sources) == {0: 0, 1: 1, 2: 0, 3: 1}


def test_node_and_its_holder_lost_together_falls_back():
    """3 nodes x 1, ranks 1 and 2 lost: rank 1's replica was on rank 2: storage, named why."""
    plan = plan_peer_recovery([1, 2, 0], frozenset({1, 2}), {0: 4}, {})
    assert plan.fallback is not None and "rank 1" in plan.fallback and "rank 2" in plan.fallback


def test_replicas_of_different_steps_fall_back():
    """A refresh in flight when the node died: the steps disagree, no mixed state."""
    plan = plan_peer_recovery([1, 0], frozenset({1}), {0: 20}, {1: 10})
    assert plan.fallback is not None and "different steps" in plan.fallback


def test_newer_committed_checkpoint_wins():
    """A checkpoint newer than the replicas is loaded instead."""
    plan = plan_peer_recovery([1, 0], frozenset({1}), {0: 10}, {1: 10}, committed_step=12)
    assert plan.fallback is not None and "newer" in plan.fallback
