"""Property tests for DESIGN.md decision 5: resizes never change what an epoch trains.

A simulated job runs one epoch as a sequence of segments; each segment has its own world
size and runs some steps, then every rank saves state (JSON round trip, as in a checkpoint
manifest) and the next segment's ranks load it. Whatever the sequence:

- the global batch of every step is exactly the one a single rank without failures trains;
- with drop_last=True every sample in the first (n // G) * G positions of the permutation
  is trained exactly once and the rest not at all;
- with drop_last=False every sample is trained once, plus once more for each padded
  position (the first ceil(n/G)*G - n positions of the permutation, wrapped).
"""

from __future__ import annotations

import json
from collections import Counter

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from elasticd.data.permutation import FeistelPermutation
from elasticd.data.sampler import ElasticSampler


def run_epoch(n, global_batch_size, segments, *, epoch, **kwargs):
    """Train one epoch through (world_size, steps) segments; the last runs to the end.

    Returns the global batch of each step (ranks' shares concatenated in rank order).
    """
    state = None
    batches = []
    for i, (world_size, steps) in enumerate(segments):
        samplers = [
            ElasticSampler(
                n,
                global_batch_size=global_batch_size,
                num_replicas=world_size,
                rank=r,
                **kwargs,
            )
            for r in range(world_size)
        ]
        for sampler in samplers:
            if state is not None:
                sampler.load_state_dict(state)
            sampler.set_epoch(epoch)
        iterators = [s.iter_steps() for s in samplers]
        left = samplers[0].steps_remaining
        todo = left if i == len(segments) - 1 else min(steps, left)
        for _ in range(todo):
            shares = [next(it) for it in iterators]
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
            assert all(shares), "every rank trains in every step"
            batches.append(sum(shares, []))
            for sampler in samplers:
                sampler.step()
        saved = [json.loads(json.dumps(s.state_dict())) for s in samplers]
        assert all(s == saved[0] for s in saved), "ranks agree on the state"
        state = saved[0]
    assert state["samples_trained"] >= n or state["samples_trained"] + global_batch_size > n
    return batches


@st.composite
def jobs(draw):
    """A dataset, a global batch, a tail rule and a sequence of world sizes with resize points."""
    n = draw(st.integers(1, 300))
    drop_last = draw(st.booleans())
    global_batch_size = draw(st.integers(1, min(n, 48) if drop_last else 48))
    world_sizes = st.integers(1, min(global_batch_size, 9))
    segments = draw(st.lists(st.tuples(world_sizes, st.integers(0, 12)), min_size=1, max_size=6))
    return {
        "n": n,
        "global_batch_size": global_batch_size,
        "drop_last": drop_last,
        "segments": segments,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**40)),
        "epoch": draw(st.integers(0, 50)),
    }


@settings(max_examples=200, deadline=None)
@given(job=jobs())
def test_resized_epoch_trains_every_sample_once_and_same_batches(job):
    """Any resize sequence trains the same global batches as one rank, each sample once (tail rule)."""
    n, g = job["n"], job["global_batch_size"]
    kwargs = {k: job[k] for k in ("drop_last", "shuffle", "seed")}
    batches = run_epoch(n, g, job["segments"], epoch=job["epoch"], **kwargs)
    reference = run_epoch(n, g, [(1, 0)], epoch=job["epoch"], **kwargs)
    assert batches == reference

    if job["shuffle"]:
        perm = FeistelPermutation(n, seed=job["seed"], epoch=job["epoch"])
        at = perm.index
    else:
        at = int
    positions = (n // g) * g if job["drop_last"] else -(-n // g) * g
    assert len(batches) * g == positions
    expected = Counter(at(p % n) for p in range(positions))
    trained = Counter(i for batch in batches for i in batch)
    assert trained == expected
    if job["drop_last"]:
        assert max(trained.values()) == 1
    else:
        assert set(trained) == set(range(n))
        repeats = Counter(at(p % n) for p in range(n, positions))
        assert trained - Counter(range(n)) == repeats


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    global_batch_size=st.integers(1, 20),
    epochs=st.integers(1, 3),
    resize_at=st.integers(0, 40),
    sizes=st.tuples(st.integers(1, 20), st.integers(1, 20)),
)
def test_multi_epoch_resume_trains_each_epoch_once(n, global_batch_size, epochs, resize_at, sizes):
    """A crash/resize at any global step of a multi-epoch run leaves each epoch trained exactly once."""
    assume(global_batch_size <= n)
    w1, w2 = (min(w, global_batch_size) for w in sizes)

    def make(world_size, rank):
        return ElasticSampler(
            n, global_batch_size=global_batch_size, num_replicas=world_size, rank=rank, seed=7
        )

    trained = {e: Counter() for e in range(epochs)}
    samplers = [make(w1, r) for r in range(w1)]
    global_step = 0
    resized = False
    epoch = samplers[0].epoch
    while epoch < epochs:
        for s in samplers:
            s.set_epoch(epoch)
        iterators = [s.iter_steps() for s in samplers]
        for _ in range(samplers[0].steps_remaining):
            if global_step == resize_at and not resized:
                break
            for it in iterators:
                trained[epoch].update(next(it))
            for s in samplers:
                s.step()
            global_step += 1
        else:
            epoch += 1
            continue
        # Resize: save, build the new world, load, and re-enter the loop at sampler.epoch.
        state = json.loads(json.dumps(samplers[0].state_dict()))
        samplers = [make(w2, r) for r in range(w2)]
        for s in samplers:
            s.load_state_dict(state)
        resized = True
        epoch = samplers[0].epoch
    full = (n // global_batch_size) * global_batch_size
    for e in range(epochs):
        assert sum(trained[e].values()) == full
        assert max(trained[e].values()) == 1
