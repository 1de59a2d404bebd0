"""Replica fingerprint policy: who differs from the majority, who may be a source, how often
to check, and that any changed bit changes the fingerprint."""

from __future__ import annotations

import pytest
import torch

from elasticd.errors import ConfigError
from elasticd.worker.fingerprint import (
    ReplicaFingerprints,
    cadence_steps,
    fingerprint,
    judge_groups,
    judge_replicas,
    non_finite,
    state_tensors,
)

pytestmark = pytest.mark.timeout(60)  # generous: the machine is shared


def test_agreeing_replicas_name_nobody():
    """Equal fingerprints: nobody diverged, nothing to restore."""
    v = judge_replicas([7, 7, 7])
    assert v.diverged == () and v.source is None


def test_the_odd_rank_is_named_and_a_majority_rank_is_the_source():
    """One rank of three differs: it is named, and the source is a rank of the majority."""
    v = judge_replicas([7, 9, 7])
    assert v.diverged == (1,) and v.source == 0
    v = judge_replicas([9, 7, 7, 7])
    assert v.diverged == (0,) and v.source == 1 and "[0]" in v.reason


def test_a_pair_that_disagrees_has_no_source():
    """Two ranks that differ: both named, neither trusted as a source."""
    v = judge_replicas([7, 9])
    assert v.diverged == (0, 1) and v.source is None and "no majority" in v.reason


def test_a_tie_has_no_source():
    """Two against two: no majority, nobody is a source."""
    assert judge_replicas([1, 1, 2, 2]).source is None


def test_the_cadence_keeps_checks_within_the_budget():
    """A check costing 1 ms on 100 ms steps at 0.5 % runs every 2 steps; bounded both ways."""
    assert cadence_steps(0.001, 0.1, 0.005) == 2
    assert cadence_steps(0.0001, 1.0, 0.005) == 1
    assert cadence_steps(1.0, 0.001, 0.005, max_every=1000) == 1000
    assert cadence_steps(0.001, 0.0) == 1000  # no step time measured yet: the longest


def test_any_changed_bit_changes_the_fingerprint():
    """A nudge of 1e-3 or a flipped low mantissa bit changes the fingerprint; a copy does not."""
    model = torch.nn.Linear(8, 4)
    before = fingerprint(state_tensors({"model": model}))
    assert fingerprint(state_tensors({"model": torch.nn.Linear(8, 4)})) != before
    copy = torch.nn.Linear(8, 4)
    copy.load_state_dict(model.state_dict())
    assert fingerprint(state_tensors({"model": copy})) == before
    with torch.no_grad():
        model.weight[0, 0] += 1e-3
    nudged = fingerprint(state_tensors({"model": model}))
    assert nudged != before
    model.weight.data.view(torch.int32)[1, 1] ^= 1
    assert fingerprint(state_tensors({"model": model})) != nudged


def test_buffers_are_not_part_of_the_fingerprint():
    """BatchNorm's running statistics (rank-local under DDP) never make replicas differ."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    other.load_state_dict(model.state_dict())
    other(torch.randn(8, 4))  # a forward in train mode updates only the running stats
    assert not torch.equal(model[1].running_mean, other[1].running_mean)
    assert fingerprint(state_tensors({"model": other})) == fingerprint(state_tensors({"model": model}))


def test_optimizer_state_is_part_of_the_fingerprint():
    """Adam's moments count: the same weights with different moments fingerprint apart."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    before = fingerprint(state_tensors({"model": model, "optimizer": opt}))
    opt.state[model.weight]["exp_avg"][0, 0] += 1.0
    assert fingerprint(state_tensors({"model": model, "optimizer": opt})) != before


def test_a_negative_cadence_is_a_config_error():
    """fingerprint_every < 1 (other than 0: off) is refused with the fix."""
    with pytest.raises(ConfigError, match="fingerprint_every"):
        ReplicaFingerprints({}, {}, every=-1)


def test_non_finite_tensors_are_found():
    """A NaN or an infinity in a floating tensor is reported by index; integers are skipped."""
    ok, nan, inf = torch.ones(3), torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")])
    assert non_finite([ok, nan, torch.arange(3), inf]) == [1, 3]
    assert non_finite([ok]) == []


def test_a_suspect_rank_is_never_the_source_of_a_state_transfer():
    """A rank named diverged and not yet verified restored offers no state: a re-formation
    takes the newest step from another rank (rank 0 would be the source by position), the
    suspect rank is planned among those behind, and with every rank suspect nobody is a
    source and the job loads the newest checkpoint."""
    from elasticd.worker.fingerprint import offered_step
    from elasticd.worker.recovery_plan import NO_STATE, Load, Replicate, plan_replication

    assert offered_step(12, suspect=False) == 12 and offered_step(12, suspect=True) == NO_STATE
    plan = plan_replication([offered_step(12, suspect=True), 12, 12])
    assert plan == Replicate(12, 1, (0,))
    joiner = plan_replication([offered_step(12, suspect=True), NO_STATE, 12])
    assert joiner == Replicate(12, 2, (0, 1))  # a joiner is fed from the trusted rank
    assert isinstance(plan_replication([offered_step(12, suspect=True)] * 2), Load)


def test_hsdp_groups_are_judged_by_shard_coordinate():
    """Six ranks of a (3 replicas, 2 shards) mesh: rank 3 (shard 1) differs from ranks 1
    and 5 and is named by global rank with a source of its own shard; shard 0 agrees even
    though its fingerprints differ from shard 1's."""
    keys = [0, 1, 0, 1, 0, 1]
    verdicts = judge_groups([5, 8, 5, 9, 5, 8], keys)
    assert verdicts[3].diverged == (3,) and verdicts[3].source in (1, 5)
    assert verdicts[1] == verdicts[3] and "[3]" in verdicts[3].reason
    assert all(verdicts[r].diverged == () for r in (0, 2, 4))


def test_a_group_of_one_has_nothing_to_compare():
    """A pure FSDP mesh (every shard held once): nobody is ever named."""
    assert all(v.diverged == () for v in judge_groups([1, 2, 3], [0, 1, 2]).values())


def test_a_pair_of_hsdp_replicas_that_disagree_has_no_source():
    """Two replicas (two nodes) whose shard 0 differs: both ranks of shard 0 are named, no source."""
    verdicts = judge_groups([4, 6, 5, 6], [0, 1, 0, 1])
    assert verdicts[0].diverged == (0, 2) and verdicts[0].source is None
    assert verdicts[1].diverged == ()


def test_a_non_finite_state_is_never_the_source_of_a_state_transfer():
    """A rank whose state holds a NaN offers no state: another rank holding the step is the
    source (the next tier), and with every holder non-finite the job loads the checkpoint
    (the tier after); a finite rank offers its step as before."""
    from elasticd.worker.fingerprint import offered_step
    from elasticd.worker.recovery_plan import NO_STATE, Load, Replicate, plan_replication

    model = torch.nn.Linear(4, 2)
    finite = not non_finite(state_tensors({"model": model}))
    assert offered_step(12, suspect=False, finite=finite) == 12
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    finite = not non_finite(state_tensors({"model": model}))
    assert offered_step(12, suspect=False, finite=finite) == NO_STATE
    assert plan_replication([offered_step(12, suspect=False, finite=False), 12, NO_STATE]) \
        == Replicate(12, 1, (0, 2))
    assert isinstance(plan_replication([offered_step(12, suspect=False, finite=False)] * 3), Load)
