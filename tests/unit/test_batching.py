"""Constant global batch: plans, errors, no_sync accumulation, loss scaling, batch sampler."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from elasticd.data import (
    BatchPlan,
    ElasticBatchSampler,
    ElasticSampler,
    accumulation_contexts,
    plan_global_batch,
)
from elasticd.errors import ConfigError


def test_even_plan_uses_fewest_micro_steps():
    """256 over 4 ranks with micro-batches of at most 48: 2 micro-steps of 32."""
    plan = plan_global_batch(256, 4, 48)
    assert (plan.micro_batch_size, plan.accumulation_steps, plan.even) == (32, 2, True)
    assert plan.micro_batch_sizes(3) == (32, 32)
    assert plan.loss_scale(32) == 0.5
    assert "4 ranks x 2 micro-steps x 32 samples" in plan.reason


@settings(max_examples=200, deadline=None)
@given(g=st.integers(1, 600), w=st.integers(1, 40), m=st.integers(1, 128))
def test_even_plans_split_exactly_or_raise(g, w, m):
    """micro * accum * W == G with micro <= max and no larger fitting divisor, else ConfigError."""
    if g < w or g % w:
        with pytest.raises(ConfigError):
            plan_global_batch(g, w, m)
        return
    plan = plan_global_batch(g, w, m)
    assert plan.micro_batch_size * plan.accumulation_steps * w == g
    assert plan.micro_batch_size <= m
    share = g // w
    assert not any(share % d == 0 for d in range(plan.micro_batch_size + 1, m + 1))


@settings(max_examples=200, deadline=None)
@given(g=st.integers(1, 600), w=st.integers(1, 40), m=st.integers(1, 128))
def test_uneven_plans_cover_the_global_batch(g, w, m):
    """allow_uneven: all micro-batches non-empty, <= max, differ by <= 1, and sum to G."""
    if g < w:
        with pytest.raises(ConfigError, match="smaller than the world size"):
            plan_global_batch(g, w, m, allow_uneven=True)
        return
    largest = -(-g // w)
    if -(-largest // m) > g // w:
        with pytest.raises(ConfigError, match="empty"):
            plan_global_batch(g, w, m, allow_uneven=True)
        return
    plan = plan_global_batch(g, w, m, allow_uneven=True)
    assert plan.accumulation_steps == -(-largest // m)
    sizes = [plan.micro_batch_sizes(r) for r in range(w)]
    assert sum(map(sum, sizes)) == g
    flat = [s for rank in sizes for s in rank]
    assert min(flat) >= 1 and max(flat) == plan.micro_batch_size <= m
    assert all(max(r) - min(r) <= 1 for r in sizes)
    assert plan.even == (min(flat) == max(flat))


def test_uneven_error_lists_what_would_work():
    """The ConfigError for 256 over 3 ranks names 255/258, dividing world sizes and allow_uneven."""
    with pytest.raises(ConfigError) as err:
        plan_global_batch(256, 3, 64)
    message = str(err.value)
    assert "255 or 258" in message
    assert "1, 2, 4, 8" in message
    assert "allow_uneven=True" in message
    assert err.value.exit_code == 78


def test_share_without_good_divisor_is_explained():
    """A prime share forces micro-batch 1 in an even plan; the reason says so and names the fix."""
    plan = plan_global_batch(254, 2, 64)
    assert (plan.micro_batch_size, plan.accumulation_steps) == (1, 127)
    assert "allow_uneven=True would run 2 micro-steps" in plan.reason
    uneven = plan_global_batch(254, 2, 64, allow_uneven=True)
    assert uneven.micro_batch_sizes(0) == (64, 63)


@pytest.mark.parametrize(("args", "match"), [((8, 2, 0), "max_micro_batch"), ((0, 1, 4), ">= 1")])
def test_bad_sizes_raise_config_error(args, match):
    """Non-positive sizes are config errors."""
    with pytest.raises(ConfigError, match=match):
        plan_global_batch(*args)


class FakeDDP:
    """Counts no_sync() entries like DDP's context manager would suppress all-reduce."""

    def __init__(self):
        self.synced = []

    @contextlib.contextmanager
    def no_sync(self):
        self.synced.append(False)
        yield


def test_accumulation_contexts_skip_sync_on_all_but_last():
    """no_sync() wraps every micro-step but the last; plain modules get null contexts."""
    model = FakeDDP()
    contexts = list(accumulation_contexts(model, plan_global_batch(64, 2, 8)))
    assert len(contexts) == 4
    for ctx in contexts:
        with ctx:
            pass
    assert model.synced == [False, False, False]
    assert all(
        isinstance(c, contextlib.nullcontext)
        for c in accumulation_contexts(torch.nn.Linear(1, 1), 3)
    )
    assert len(list(accumulation_contexts(model, 1))) == 1
    with pytest.raises(ValueError):
        list(accumulation_contexts(model, 0))


def _mean_gradient_through_plan(weight, x, y, plan):
    """The gradient DDP would produce: per-rank accumulated, loss-scaled, averaged over ranks."""
    grads = []
    start = 0
    for rank in range(plan.world_size):
        w = weight.clone().requires_grad_(True)
        for size in plan.micro_batch_sizes(rank):
            xs, ys = x[start : start + size], y[start : start + size]
            start += size
            loss = ((xs @ w - ys) ** 2).mean() * plan.loss_scale(size)
            loss.backward()
        grads.append(w.grad)
    return torch.stack(grads).mean(0)  # DDP's all-reduce averages over ranks


@settings(max_examples=60, deadline=None)
@given(g=st.integers(2, 60), w=st.integers(1, 8), m=st.integers(2, 16))
def test_loss_scale_gives_global_mean_gradient_at_any_world_size(g, w, m):
    """loss.mean() * loss_scale(len) makes the averaged gradient the global-batch mean, even uneven."""
    if g < w:
        return
    plan = plan_global_batch(g, w, m, allow_uneven=True)
    gen = torch.Generator().manual_seed(g * 1000 + w)
    x = torch.randn(g, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(g, generator=gen, dtype=torch.float64)
    weight = torch.randn(3, generator=gen, dtype=torch.float64)
    reference = weight.clone().requires_grad_(True)
    ((x @ reference - y) ** 2).mean().backward()
    torch.testing.assert_close(_mean_gradient_through_plan(weight, x, y, plan), reference.grad)


def test_plain_division_by_accumulation_is_wrong_for_uneven_shares():
    """Why loss_scale exists: loss / accum over uneven shares is not the global mean gradient."""
    plan = plan_global_batch(7, 2, 2, allow_uneven=True)  # shares 4 and 3, 2 micro-steps
    assert plan.micro_batch_sizes(0) == (2, 2) and plan.micro_batch_sizes(1) == (2, 1)
    assert plan.loss_scale(1) != 1 / plan.accumulation_steps


def test_batch_sampler_aligns_micro_batches_with_steps():
    """Each optimizer step yields accumulation_steps micro-batches that reassemble the rank's share."""
    plan = plan_global_batch(20, 3, 4, allow_uneven=True)  # shares 7, 7, 6; 2 micro-steps
    sampler = ElasticSampler(100, global_batch_size=20, num_replicas=3, rank=2, seed=1)
    batches = ElasticBatchSampler(sampler, plan)
    loader = DataLoader(list(range(100)), batch_sampler=batches)
    micro = [b.tolist() for b in loader]
    shares = list(sampler.iter_steps())
    assert len(micro) == len(batches) == 5 * plan.accumulation_steps
    for step, share in enumerate(shares):
        pair = micro[2 * step : 2 * step + 2]
        assert [len(b) for b in pair] == list(plan.micro_batch_sizes(2))
        assert pair[0] + pair[1] == share
    assert sampler.samples_trained == 0


def test_batch_sampler_refuses_a_plan_for_another_world():
    """A plan made for another world size or global batch is a config error."""
    sampler = ElasticSampler(100, global_batch_size=20, num_replicas=4, rank=0)
    with pytest.raises(ConfigError, match="same values"):
        ElasticBatchSampler(sampler, plan_global_batch(20, 2, 4))
    assert isinstance(plan_global_batch(20, 4, 5), BatchPlan)


def _train(world_sizes_and_steps, *, n=90, global_batch=10, max_micro=3, epochs=2):
    """Run the documented loop with simulated DDP (grads averaged over ranks) through resizes.

    Each (world_size, steps) segment trains that many optimizer steps, then "checkpoints"
    (model weight + sampler state) and the next segment resumes from it; the last segment
    runs to the end. Returns the final weight.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(n, generator=gen, dtype=torch.float64)
    weight = torch.zeros(3, dtype=torch.float64)
    state = None
    for i, (world_size, budget) in enumerate(world_sizes_and_steps):
        last = i == len(world_sizes_and_steps) - 1
        plan = plan_global_batch(global_batch, world_size, max_micro, allow_uneven=True)
        samplers = [
            ElasticSampler(n, global_batch_size=global_batch, num_replicas=world_size, rank=r)
            for r in range(world_size)
        ]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        done = 0
        for epoch in range(samplers[0].epoch, epochs):
            for s in samplers:
                s.set_epoch(epoch)
            loaders = [iter(ElasticBatchSampler(s, plan)) for s in samplers]
            for _ in range(samplers[0].steps_remaining):
                if not last and done == budget:
                    break
                grads = []
                for loader in loaders:  # each simulated rank
                    w = weight.clone().requires_grad_(True)
                    for ctx in accumulation_contexts(w, plan):
                        idx = next(loader)
                        with ctx:
                            loss = ((x[idx] @ w - y[idx]) ** 2).mean()
                            (loss * plan.loss_scale(len(idx))).backward()
                    grads.append(w.grad)
                weight = weight - 0.1 * torch.stack(grads).mean(0)  # all-reduce + SGD
                for s in samplers:
                    s.step()
                done += 1
            else:
                continue
            break
        state = samplers[0].state_dict()
    return weight


def test_training_through_resizes_matches_an_uninterrupted_run():
    """The documented loop, resized 1->3->4->2 ranks mid-epoch (uneven shares), ends at the 1-rank weights."""
    reference = _train([(1, 0)])
    resized = _train([(1, 4), (3, 5), (4, 2), (2, 0)])
    torch.testing.assert_close(resized, reference)
    assert not torch.equal(reference, torch.zeros(3, dtype=torch.float64))


def test_batch_smaller_than_world_names_the_world_sizes_that_work():
    """The error for a global batch below the world size says which world sizes work."""
    with pytest.raises(ConfigError, match=r"World sizes that work with this global batch: 1\.\.3"):
        plan_global_batch(3, 4, 8)


def test_a_plan_is_re_planned_for_another_world_with_its_bound_and_tail_rule():
    """for_world keeps the global batch, memory bound and allow_uneven; an even plan that a
    new world size does not split says so."""
    plan = plan_global_batch(16, 2, 16, allow_uneven=True)
    one, three = plan.for_world(1), plan.for_world(3)
    assert (one.world_size, one.micro_batch_sizes(0), one.accumulation_steps) == (1, (16,), 1)
    assert three.micro_batch_sizes(0) == (6,) and three.micro_batch_sizes(2) == (5,)
    assert plan.for_world(2) is plan
    assert plan_global_batch(16, 2, 4).for_world(1).micro_batch_sizes(0) == (4, 4, 4, 4)
    with pytest.raises(ConfigError, match="allow_uneven=True"):
        plan_global_batch(16, 2, 16).for_world(3)


def test_batch_sampler_follows_a_regrouped_sampler():
    """After a live shrink (regroup to world 1) the batch sampler cuts the whole new share,
    not the old plan's part of it, and its plan (loss scale) is the new world's."""
    sampler = ElasticSampler(64, global_batch_size=16, num_replicas=2, rank=1, seed=3)
    batches = ElasticBatchSampler(sampler, plan_global_batch(16, 2, 16, allow_uneven=True))
    assert [len(b) for b in batches][:1] == [8]
    sampler.step()
    sampler.regroup(1, 0)
    got = list(batches)
    assert [len(b) for b in got] == [16, 16, 16] and len(batches) == 3
    assert sorted(i for b in got for i in b) == sorted(list(sampler)), "every remaining sample"
    assert (batches.plan.world_size, batches.plan.loss_scale(16)) == (1, 1.0)
