"""Per-sample seeds: a sample's augmentation depends on (seed, epoch, position) only."""

from __future__ import annotations

import pytest
import torch

from elasticd.data import (
    ElasticBatchSampler,
    ElasticSampler,
    PositionedBatchSampler,
    PositionedSampler,
    SampleKey,
    SeededDataset,
    plan_global_batch,
    sample_generator,
    sample_seed,
)
from elasticd.data.positions import iter_step_positions


def _noise(item, gen):
    return item + torch.randn(3, generator=gen, dtype=torch.float64)


def test_sample_seed_is_a_pure_function_of_its_key():
    """Same (seed, epoch, position) -> same seed; any component changed -> another seed."""
    assert sample_seed(7, 2, 1000) == sample_seed(7, 2, 1000)
    seeds = {sample_seed(s, e, p) for s in range(3) for e in range(3) for p in range(200)}
    assert len(seeds) == 3 * 3 * 200
    assert all(0 <= s < 2**63 for s in seeds)
    a = torch.rand(4, generator=sample_generator(7, 2, 1000))
    assert torch.equal(a, torch.rand(4, generator=sample_generator(7, 2, 1000)))


@pytest.mark.parametrize(("n", "g", "w", "shuffle", "drop_last", "trained"), [
    (100, 12, 1, True, True, 0), (100, 12, 5, True, False, 24), (7, 10, 3, True, False, 0),
    (1000, 64, 3, False, True, 128), (50, 7, 2, True, False, 49)])
def test_positions_name_the_samplers_indices(n, g, w, shuffle, drop_last, trained):
    """iter_step_positions yields exactly the sampler's indices, plus their positions."""
    for r in range(w):
        s = ElasticSampler(n, global_batch_size=g, num_replicas=w, rank=r, shuffle=shuffle,
                           seed=3, drop_last=drop_last)
        s.load_state_dict({**s.state_dict(), "samples_trained": trained})
        steps = list(iter_step_positions(s))
        assert [i for i, _ in steps] == list(s.iter_steps())
        positions = [p for _, ps in steps for p in ps]
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
        assert all(p >= trained for p in positions)


def _global_batches(world: int, resume_at_step: int = 0) -> list[list[tuple[int, int, bytes]]]:
    """Per step: [(position, index, augmented bytes)] over all ranks at this world size."""
    base = torch.arange(60, dtype=torch.float64).repeat(3, 1).T.contiguous()
    ds = SeededDataset(base, _noise)
    steps: list[list[tuple[int, int, bytes]]] = []
    for r in range(world):
        s = ElasticSampler(60, global_batch_size=12, num_replicas=world, rank=r, seed=5)
        s.load_state_dict({**s.state_dict(), "samples_trained": 12 * resume_at_step})
        plan = plan_global_batch(12, world, 4, allow_uneven=True)
        keys = [k for batch in PositionedBatchSampler(ElasticBatchSampler(s, plan)) for k in batch]
        for j, k in enumerate(keys):
            step = j // s.share_size
            while len(steps) <= step:
                steps.append([])
            steps[step].append((k.position, k.index, ds[k].numpy().tobytes()))
    return [sorted(b) for b in steps]


def test_augmentations_do_not_depend_on_world_size_or_resume_point():
    """The same position gets the same sample and the same augmented tensor at W=1,2,5 and
    after a mid-epoch resume."""
    ref = _global_batches(1)
    assert _global_batches(2) == ref
    assert _global_batches(5) == ref
    assert _global_batches(3, resume_at_step=2) == ref[2:]


def test_positioned_sampler_matches_the_sampler_and_keys_pickle():
    """PositionedSampler yields one key per sampler index, in order, and keys survive pickling."""
    import pickle

    s = ElasticSampler(30, global_batch_size=6, num_replicas=2, rank=1, seed=1)
    keys = list(PositionedSampler(s))
    assert [k.index for k in keys] == list(s) and len(PositionedSampler(s)) == len(s)
    assert pickle.loads(pickle.dumps(keys[0])) == keys[0]
    assert isinstance(keys[0], SampleKey) and keys[0].epoch == 0 and keys[0].seed == 1


def test_seeded_dataset_refuses_a_bare_index():
    """A bare int has no position: SeededDataset says to wrap the sampler."""
    ds = SeededDataset([1, 2, 3], lambda x, g: x)
    with pytest.raises(TypeError, match="PositionedSampler"):
        ds[0]
