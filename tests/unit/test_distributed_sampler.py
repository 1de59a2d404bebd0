"""ElasticDistributedSampler: DistributedSampler's contract, plus exactly-once resume."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from elasticd.data import ElasticDistributedSampler, ElasticSampler
from elasticd.errors import ConfigError


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "w"), [(10, 3), (12, 4), (5, 7), (100, 1)])
def test_unshuffled_order_is_torchs(n, w, drop_last):
    """shuffle=False yields what torch's DistributedSampler yields, rank for rank."""
    for r in range(w):
        ours = ElasticDistributedSampler(n, w, r, shuffle=False, drop_last=drop_last)
        theirs = DistributedSampler(list(range(n)), w, r, shuffle=False, drop_last=drop_last)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


def _train(n, segments, seed=0, drop_last=False):
    """Run resize segments [(world, per-rank batch, steps)], then finish at the last world.

    Returns the multiset of trained samples and the final state."""
    state = None
    counts: Counter = Counter()
    for i, (w, b, steps) in enumerate(segments):
        last = i == len(segments) - 1
        ranks = [ElasticDistributedSampler(n, w, r, seed=seed, drop_last=drop_last) for r in range(w)]
        for s in ranks:
            if state is not None:
                s.load_state_dict(state)
        streams = [list(s) for s in ranks]
        done = 0
        while (last or done < steps) and streams[0][done * b:]:
            k = len(streams[0][done * b:(done + 1) * b])
            for r, s in enumerate(ranks):
                counts.update(streams[r][done * b:done * b + k])
                s.step(k)
            done += 1
        state = ranks[0].state_dict()
    return counts, state


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), segments=st.lists(
    st.tuples(st.integers(1, 6), st.integers(1, 9), st.integers(0, 6)), min_size=1, max_size=5),
    seed=st.integers(0, 3))
def test_any_resize_sequence_trains_every_sample_exactly_once(n, segments, seed):
    """Any world sizes, per-rank batches and resize points: with drop_last=False every sample
    is trained at least once, and only padding (< world size) repeats; drop_last=True: at most
    once, fewer than a world size dropped."""
    widest = max(w for w, _, _ in segments)
    counts, _ = _train(n, segments, seed)
    assert set(counts) == set(range(n))
    assert sum(counts.values()) - n < widest
    counts, _ = _train(n, segments, seed, drop_last=True)
    assert max(counts.values(), default=1) == 1 and n - len(counts) < widest


def test_state_round_trip_and_refusals():
    """State loads at another world size; another order or another sampler's state is refused."""
    s = ElasticDistributedSampler(100, 4, 0, seed=3)
    s.set_epoch(2)
    s.step(5)
    t = ElasticDistributedSampler(100, 3, 2, seed=3)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.samples_trained, len(t)) == (2, 20, 27)
    with pytest.raises(ConfigError, match="seed"):
        ElasticDistributedSampler(100, 3, 0, seed=4).load_state_dict(s.state_dict())
    with pytest.raises(ConfigError, match="ElasticDistributedSampler"):
        t.load_state_dict(ElasticSampler(100, global_batch_size=4, num_replicas=1, rank=0).state_dict())
    with pytest.raises(RuntimeError, match="left in epoch"):
        t.step(28)


def test_positions_mode_yields_keys_for_the_same_indices():
    """positions=True yields SampleKeys naming the same indices, positions strided by W."""
    plain = list(ElasticDistributedSampler(20, 3, 1, seed=2))
    keys = list(ElasticDistributedSampler(20, 3, 1, seed=2, positions=True))
    assert [k.index for k in keys] == plain
    assert [k.position for k in keys] == [1 + 3 * j for j in range(7)]


def test_regroup_in_place_continues_exactly_once_at_the_new_world_size():
    """A live re-formation reshards the same sampler objects in place (no state round trip):
    2 ranks train 3 steps, the survivors regroup to 3 ranks, and every sample of the epoch
    is trained once; ElasticSampler keeps its global batch across the change."""
    n, b = 50, 4
    ranks = [ElasticDistributedSampler(n, num_replicas=2, rank=r, shuffle=True, seed=3) for r in range(2)]
    seen: Counter = Counter()
    iters = [iter(s) for s in ranks]
    for _ in range(3):
        for it in iters:
            seen.update(next(it) for _ in range(b))
        for s in ranks:
            s.step(b)
    ranks.append(ElasticDistributedSampler(n, num_replicas=3, rank=2, shuffle=True, seed=3))
    ranks[2].load_state_dict(ranks[0].state_dict())  # the joiner gets the state from a peer
    for r, s in enumerate(ranks):
        s.regroup(num_replicas=3, rank=r)
    while not ranks[0].epoch_done:
        share = [list(s)[:b] for s in ranks]
        k = min(len(x) for x in share)
        for x in share:
            seen.update(x[:k])
        for s in ranks:
            s.step(k)
    assert set(seen) == set(range(n)) and max(seen.values()) <= 2  # padding wraps, as torch's
    assert sum(seen.values()) - n <= 2
    es = ElasticSampler(48, global_batch_size=12, num_replicas=2, rank=1)
    es.regroup(num_replicas=3, rank=2)
    assert (es.num_replicas, es.rank, es.global_batch_size) == (3, 2, 12)
    with pytest.raises(ValueError):
        ranks[0].regroup(num_replicas=2, rank=2)
