"""ElasticSampler behaviour: shares, tail rule, trained counter, epochs, state, config errors."""

from __future__ import annotations

import json

import pytest
import structlog
from torch.utils.data import DataLoader

from elasticd.data import sampler as sampler_module
from elasticd.data.permutation import FeistelPermutation
from elasticd.data.sampler import ElasticSampler
from elasticd.data.sharding import rank_share, steps_remaining
from elasticd.errors import ConfigError


def perm_at(n, seed, epoch, positions):
    """Reference: sample indices at epoch positions (padded ones wrap)."""
    perm = FeistelPermutation(n, seed=seed, epoch=epoch)
    return [perm.index(p % n) for p in positions]


def global_batches(n, world_size, **kwargs):
    """The global batch of each remaining step, assembled from every rank in rank order."""
    samplers = [
        ElasticSampler(n, num_replicas=world_size, rank=r, **kwargs) for r in range(world_size)
    ]
    per_rank = [list(s.iter_steps()) for s in samplers]
    return [
        sum((per_rank[r][step] for r in range(world_size)), []) for step in range(len(per_rank[0]))
    ]


@pytest.mark.parametrize(("g", "w"), [(8, 1), (8, 2), (8, 3), (10, 4), (7, 7), (100, 6)])
def test_rank_shares_tile_the_global_batch(g, w):
    """Contiguous shares, the first G mod W ranks one larger, cover the global batch exactly."""
    shares = [rank_share(g, w, r) for r in range(w)]
    assert shares[0][0] == 0
    for (off, length), (next_off, _) in zip(shares, shares[1:], strict=False):
        assert off + length == next_off
    assert shares[-1][0] + shares[-1][1] == g
    assert max(s[1] for s in shares) - min(s[1] for s in shares) <= 1
    assert [s[1] for s in shares] == sorted((s[1] for s in shares), reverse=True)


def test_steps_remaining_tail_rule():
    """drop_last counts only full global batches; padding counts the partial one."""
    assert steps_remaining(10, 4, 0, drop_last=True) == 2
    assert steps_remaining(10, 4, 0, drop_last=False) == 3
    assert steps_remaining(10, 4, 8, drop_last=True) == 0
    assert steps_remaining(10, 4, 8, drop_last=False) == 1
    assert steps_remaining(10, 4, 12, drop_last=False) == 0
    assert steps_remaining(3, 8, 0, drop_last=False) == 1


def test_single_rank_walks_the_permutation():
    """At world size 1 the sampler yields perm[0 : (n//G)*G] in order."""
    sampler = ElasticSampler(103, global_batch_size=10, seed=4)
    assert list(sampler) == perm_at(103, 4, 0, range(100))
    assert len(sampler) == 100


def test_global_batch_is_independent_of_world_size():
    """Every step trains the same indices, in the same order, at world sizes 1..7."""
    expected = global_batches(50, 1, global_batch_size=7, seed=2)
    for w in range(2, 8):
        assert global_batches(50, w, global_batch_size=7, seed=2) == expected


def test_drop_last_false_pads_by_wrapping():
    """The partial last global batch is completed from the start of the permutation."""
    batches = global_batches(10, 3, global_batch_size=4, drop_last=False, seed=1)
    assert len(batches) == 3
    assert batches[-1] == perm_at(10, 1, 0, [8, 9, 10, 11])
    assert batches[-1][2:] == perm_at(10, 1, 0, [0, 1])


def test_global_batch_larger_than_dataset_wraps_repeatedly():
    """With drop_last=False a global batch larger than the dataset repeats the permutation."""
    batches = global_batches(3, 4, global_batch_size=8, drop_last=False, seed=0)
    assert batches == [perm_at(3, 0, 0, range(8))]
    counts = sorted(batches[0].count(i) for i in range(3))
    assert counts == [2, 3, 3]


def test_dataset_smaller_than_world_gives_every_rank_a_sample():
    """n < W works with drop_last=False: padding fills every rank's share."""
    samplers = [
        ElasticSampler(2, global_batch_size=4, num_replicas=4, rank=r, drop_last=False)
        for r in range(4)
    ]
    assert [len(list(s)) for s in samplers] == [1, 1, 1, 1]


def test_shuffle_false_yields_positions_in_order():
    """shuffle=False trains samples 0..n-1 in order, sharded the same way."""
    assert global_batches(10, 2, global_batch_size=4, shuffle=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert global_batches(10, 3, global_batch_size=4, shuffle=False, drop_last=False)[-1] == [
        8,
        9,
        0,
        1,
    ]


def test_iteration_does_not_move_the_trained_counter():
    """Consuming (prefetching) indices leaves samples_trained alone; only step() advances it."""
    sampler = ElasticSampler(100, global_batch_size=10, num_replicas=2, rank=1)
    loader = DataLoader(list(range(100)), sampler=sampler, batch_size=5)
    assert len(list(loader)) == 10
    assert sampler.samples_trained == 0
    sampler.step()
    sampler.step(2)
    assert sampler.samples_trained == 30
    assert sampler.steps_remaining == 7
    assert len(sampler) == 35


def test_iteration_starts_where_training_stopped():
    """A new iterator starts at the first untrained global batch; an old one is unaffected."""
    sampler = ElasticSampler(100, global_batch_size=10, num_replicas=2, rank=0)
    before = sampler.iter_steps()
    sampler.step(3)
    after = sampler.iter_steps()
    assert next(before) == perm_at(100, 0, 0, range(0, 5))
    assert next(after) == perm_at(100, 0, 0, range(30, 35))


def test_step_past_epoch_end_is_refused():
    """Calling step() more often than the epoch has global batches raises with a fix."""
    sampler = ElasticSampler(20, global_batch_size=10)
    sampler.step(2)
    with pytest.raises(RuntimeError, match="set_epoch"):
        sampler.step()
    with pytest.raises(ValueError):
        sampler.step(0)


def test_set_epoch_resets_unless_same_epoch():
    """set_epoch(other) starts at position 0 with a new order; set_epoch(current) keeps position."""
    sampler = ElasticSampler(100, global_batch_size=10, seed=3)
    sampler.step(4)
    sampler.set_epoch(0)
    assert sampler.samples_trained == 40
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.samples_trained) == (1, 0)
    assert list(sampler) == perm_at(100, 3, 1, range(100))


def test_set_epoch_backwards_logs_a_warning():
    """Going back to an earlier epoch (a loop not started at sampler.epoch) is logged."""
    sampler = ElasticSampler(100, global_batch_size=10)
    sampler.set_epoch(5)
    with structlog.testing.capture_logs() as logs:
        sampler.set_epoch(0)
    assert [e["event"] for e in logs] == ["sampler_epoch_rewound"]


def test_resume_mid_epoch_at_another_world_size():
    """State saved at step k under W=4 resumes at step k+1 under W=3, mid-epoch, via set_epoch."""
    old = ElasticSampler(200, global_batch_size=12, num_replicas=4, rank=2, seed=8)
    old.set_epoch(3)
    old.step(5)
    state = json.loads(json.dumps(old.state_dict()))
    new = [
        ElasticSampler(200, global_batch_size=12, num_replicas=3, rank=r, seed=8) for r in range(3)
    ]
    for s in new:
        s.load_state_dict(state)
    for epoch in range(new[0].epoch, 4):
        for s in new:
            s.set_epoch(epoch)
    first = sum((next(s.iter_steps()) for s in new), [])
    assert first == perm_at(200, 8, 3, range(60, 72))
    assert all(s.steps_remaining == 200 // 12 - 5 for s in new)


def test_finished_epoch_resumes_into_the_next():
    """A state saved after an epoch's last step yields nothing for it; the next epoch starts fresh."""
    sampler = ElasticSampler(30, global_batch_size=10)
    sampler.step(3)
    resumed = ElasticSampler(30, global_batch_size=10)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == []
    resumed.set_epoch(1)
    assert len(list(resumed)) == 30


def test_state_is_json_and_rank_independent():
    """Every rank saves the same JSON-serialisable state."""
    states = [
        ElasticSampler(50, global_batch_size=8, num_replicas=4, rank=r).state_dict()
        for r in range(4)
    ]
    assert all(s == states[0] for s in states)
    assert json.loads(json.dumps(states[0])) == states[0]


@pytest.mark.parametrize(
    ("key", "value"), [("dataset_len", 51), ("seed", 1), ("shuffle", False), ("version", 99)]
)
def test_state_from_another_data_order_is_refused(key, value):
    """A state whose positions name other samples (dataset, seed, shuffle, version) raises ConfigError."""
    state = ElasticSampler(50, global_batch_size=8).state_dict()
    state[key] = value
    with pytest.raises(ConfigError):
        ElasticSampler(50, global_batch_size=8).load_state_dict(state)


def test_foreign_state_is_refused():
    """A dict that is not a sampler state (missing keys) raises ConfigError naming them."""
    state = ElasticSampler(50, global_batch_size=8).state_dict()
    del state["samples_trained"]
    with pytest.raises(ConfigError, match="samples_trained"):
        ElasticSampler(50, global_batch_size=8).load_state_dict(state)


def test_changed_global_batch_is_accepted_and_logged():
    """Resuming with another global batch continues from the same position and logs it."""
    old = ElasticSampler(100, global_batch_size=8)
    old.step(3)
    new = ElasticSampler(100, global_batch_size=10)
    with structlog.testing.capture_logs() as logs:
        new.load_state_dict(old.state_dict())
    assert "sampler_setting_changed" in [e["event"] for e in logs]
    assert next(new.iter_steps()) == perm_at(100, 0, 0, range(24, 34))


@pytest.mark.parametrize(
    ("n", "kwargs", "match"),
    [
        (0, {"global_batch_size": 1}, "dataset"),
        (10, {"global_batch_size": 0}, "global_batch_size"),
        (10, {"global_batch_size": 3, "num_replicas": 4, "rank": 0}, "smaller than the world size"),
        (10, {"global_batch_size": 11}, "drop_last"),
    ],
)
def test_unusable_configs_raise_config_error(n, kwargs, match):
    """Empty datasets, empty shares and batches that never fill are config errors naming the fix."""
    with pytest.raises(ConfigError, match=match):
        ElasticSampler(n, **kwargs)


def test_rank_outside_world_is_refused():
    """rank >= num_replicas is a ValueError, like DistributedSampler."""
    with pytest.raises(ValueError):
        ElasticSampler(10, global_batch_size=4, num_replicas=2, rank=2)


def test_world_defaults_come_from_torch_distributed(monkeypatch):
    """Without explicit rank/num_replicas the sampler reads an initialised process group."""
    alone = ElasticSampler(10, global_batch_size=4)
    assert (alone.rank, alone.num_replicas) == (0, 1)
    monkeypatch.setattr(sampler_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sampler_module.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(sampler_module.dist, "get_rank", lambda: 3)
    sampler = ElasticSampler(list(range(10)), global_batch_size=4)
    assert (sampler.rank, sampler.num_replicas, sampler.share_size) == (3, 4, 1)


def test_chunking_does_not_change_the_order(monkeypatch):
    """Computing indices in many small chunks gives the same stream as one big chunk."""
    whole = list(
        ElasticSampler(1000, global_batch_size=30, num_replicas=4, rank=1, drop_last=False)
    )
    monkeypatch.setattr(sampler_module, "_CHUNK_POSITIONS", 16)
    assert (
        list(ElasticSampler(1000, global_batch_size=30, num_replicas=4, rank=1, drop_last=False))
        == whole
    )


def test_memory_is_bounded_by_the_share_not_the_dataset():
    """For 100M samples each vectorised chunk holds O(max(share, 32k)) indices, never O(n)."""
    sampler = ElasticSampler(100_000_000, global_batch_size=4096, num_replicas=8, rank=5)
    chunks = sampler._chunks(0)
    sizes = [next(chunks).numel() for _ in range(3)]
    assert max(sizes) <= max(sampler.share_size, sampler_module._CHUNK_POSITIONS)
    first = next(iter(sampler))
    assert isinstance(first, int) and 0 <= first < 100_000_000
