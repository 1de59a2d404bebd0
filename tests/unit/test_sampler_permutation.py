"""The lazy seeded permutation behind ElasticSampler: a bijection, stable, well shuffled."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.data.permutation import PERMUTATION_ALGORITHM, FeistelPermutation, round_keys


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 1000, 4097])
def test_is_a_bijection_on_small_domains(n):
    """Every position maps to a distinct index in [0, n), including n=1 and powers of two."""
    perm = FeistelPermutation(n, seed=11, epoch=2)
    assert sorted(perm(torch.arange(n)).tolist()) == list(range(n))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3000),
    seed=st.integers(-(2**70), 2**70),
    epoch=st.integers(0, 10**6),
)
def test_tensor_path_matches_python_reference(n, seed, epoch):
    """The vectorised permutation equals the pure-Python one position by position (a bijection)."""
    perm = FeistelPermutation(n, seed=seed, epoch=epoch)
    values = perm(torch.arange(n)).tolist()
    assert values == [perm.index(p) for p in range(n)]
    assert sorted(values) == list(range(n))


def test_data_order_is_pinned():
    """The order for a given (n, seed, epoch) never changes silently (it names checkpointed positions)."""
    assert PERMUTATION_ALGORITHM == "feistel6-mixedradix-lowbias32-v1"
    perm = FeistelPermutation(1000, seed=0, epoch=0)
    assert [perm.index(p) for p in range(8)] == [976, 576, 678, 350, 452, 735, 811, 449]
    big = FeistelPermutation(100_000_000, seed=1234, epoch=7)
    assert big(torch.arange(4)).tolist() == [33988339, 40960794, 53352381, 52091241]


def test_keeps_shape_and_handles_scattered_positions():
    """Any-shaped position tensors map elementwise, wherever the positions lie."""
    perm = FeistelPermutation(10_000, seed=5, epoch=1)
    positions = torch.tensor([[9999, 0, 17], [5000, 1, 42]])
    out = perm(positions)
    assert out.shape == positions.shape
    assert out.reshape(-1).tolist() == [perm.index(p) for p in positions.reshape(-1).tolist()]


def test_seed_and_epoch_give_unrelated_orders():
    """Changing the seed or the epoch reshuffles (and the round keys differ)."""
    n = 5000
    base = FeistelPermutation(n, seed=0, epoch=0)(torch.arange(n))
    other_epoch = FeistelPermutation(n, seed=0, epoch=1)(torch.arange(n))
    other_seed = FeistelPermutation(n, seed=1, epoch=0)(torch.arange(n))
    assert (base == other_epoch).float().mean() < 0.01
    assert (base == other_seed).float().mean() < 0.01
    assert len({round_keys(0, 0), round_keys(0, 1), round_keys(1, 0)}) == 3


def test_order_looks_random():
    """Positions and indices are uncorrelated and neighbours are far apart (no affine pattern)."""
    n = 100_000
    values = FeistelPermutation(n, seed=3, epoch=0)(torch.arange(n)).double()
    positions = torch.arange(n, dtype=torch.float64)
    corr = torch.corrcoef(torch.stack([positions, values]))[0, 1].item()
    assert abs(corr) < 0.02
    # For a uniform random permutation E|v[i+1]-v[i]| = n/3.
    gap = (values[1:] - values[:-1]).abs().mean().item()
    assert abs(gap / n - 1 / 3) < 0.02
    # First-differences of an affine map take one or two values; a shuffle takes ~n.
    assert (values[1:] - values[:-1]).unique().numel() > n // 2


def test_index_rejects_out_of_range_and_bad_sizes():
    """Out-of-range positions and unsupported sizes are refused."""
    perm = FeistelPermutation(10, seed=0, epoch=0)
    with pytest.raises(IndexError):
        perm.index(10)
    with pytest.raises(ValueError):
        FeistelPermutation(0, seed=0, epoch=0)
    with pytest.raises(ValueError):
        FeistelPermutation(2**62 + 1, seed=0, epoch=0)


def test_largest_domain_stays_in_range():
    """At n = 2**62 (the supported maximum) arithmetic does not overflow int64."""
    n = 2**62
    perm = FeistelPermutation(n, seed=9, epoch=3)
    positions = torch.tensor([0, 1, n - 1, n // 2])
    out = perm(positions)
    assert out.tolist() == [perm.index(p) for p in positions.tolist()]
    assert bool(((out >= 0) & (out < n)).all())


def test_small_domains_reach_every_order():
    """Over many seeds a 4-sample dataset sees all 24 orders and each first sample ~evenly."""
    orders = [
        tuple(FeistelPermutation(4, seed=s, epoch=0).index(i) for i in range(4))
        for s in range(2000)
    ]
    assert len(set(orders)) == 24
    firsts = [orders.count(o) for o in set(orders)]
    assert min(firsts) > 2000 / 24 / 2
    for sample in range(4):
        assert abs(sum(o[0] == sample for o in orders) / 2000 - 0.25) < 0.05
