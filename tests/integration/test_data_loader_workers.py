"""Real DataLoader worker processes and prefetching: resumes train every sample exactly once.

Each test trains part of an epoch through a DataLoader with ``num_workers=2`` and a deep
prefetch, takes the state while batches are still read ahead, throws the loader away (as a
crash or a drain does), and resumes at another world size. All ranks of a world run in this
process, each with its own loader and worker processes; the global batch of a step is the
union of the ranks' shares. The sequence of global batches (positions, indices and
augmented tensors) must equal an uninterrupted run's.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from elasticd.data import (
    ElasticBatchSampler,
    ElasticDistributedSampler,
    ElasticSampler,
    ElasticStream,
    PositionedBatchSampler,
    SeededDataset,
    Shard,
    plan_global_batch,
)

pytestmark = pytest.mark.timeout(120)
N, G, MICRO = 90, 12, 3


def _augment(item: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    flip = torch.rand((), generator=gen) < 0.5
    noisy = item + 0.1 * torch.randn(item.shape, generator=gen, dtype=item.dtype)
    return torch.cat([noisy.flip(0) if flip else noisy, item[:1]])  # last column: the index


def _dataset() -> SeededDataset:
    base = torch.arange(N, dtype=torch.float64)[:, None].repeat(1, 4)
    return SeededDataset(base, _augment)


def _rows(batch: torch.Tensor) -> list[tuple[int, bytes]]:
    return [(int(r[-1]), r.numpy().tobytes()) for r in batch]


def _elastic_segment(state, world, steps, prefetch=4):
    """Train ``steps`` global batches (None: to the epoch's end) at ``world``; returns
    (per-step sorted rows, state saved while prefetched batches are still pending)."""
    ranks = []
    for r in range(world):
        s = ElasticSampler(N, global_batch_size=G, num_replicas=world, rank=r, seed=11,
                           drop_last=False)
        if state is not None:
            s.load_state_dict(state)
        plan = plan_global_batch(G, world, MICRO, allow_uneven=True)
        loader = DataLoader(_dataset(), batch_sampler=PositionedBatchSampler(
            ElasticBatchSampler(s, plan)), num_workers=2, prefetch_factor=prefetch)
        ranks.append((s, plan, iter(loader)))
    out = []
    todo = ranks[0][0].steps_remaining if steps is None else steps
    for _ in range(todo):
        rows = []
        for _s, plan, it in ranks:
            for _ in range(plan.accumulation_steps):
                rows += _rows(next(it))
        for s, _, _ in ranks:
            s.step()
        out.append(sorted(rows))
    state = ranks[0][0].state_dict()
    del ranks  # drops the iterators with their prefetched, untrained batches
    return out, state


def test_elastic_sampler_with_workers_resumes_after_the_last_trained_batch():
    """num_workers=2, prefetch 4: a resize 2 -> 3 -> 1 mid-epoch gives the same global
    batches (indices and augmented tensors) as one uninterrupted rank."""
    ref, _ = _elastic_segment(None, 1, None)
    a, st = _elastic_segment(None, 2, 3)
    b, st = _elastic_segment(st, 3, 2)
    c, _ = _elastic_segment(st, 1, None)
    assert a + b + c == ref
    counts = Counter(i for step in ref for i, _ in step)
    assert set(counts) == set(range(N)) and sum(counts.values()) == 96  # 6 padded positions


def test_distributed_sampler_with_workers_resumes_exactly_once():
    """ElasticDistributedSampler under DataLoader(batch_size=4, num_workers=2, prefetch 4):
    2 ranks for 3 steps, then 3 ranks to the end: every sample once (padding aside), each
    with the augmentation of its position."""
    ds = _dataset()
    seen: list[tuple[int, bytes]] = []
    state = None
    for world, steps in ((2, 3), (3, None)):
        samplers = [ElasticDistributedSampler(N, world, r, seed=4, positions=True) for r in range(world)]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        iters = [iter(DataLoader(ds, batch_size=4, sampler=s, num_workers=2, prefetch_factor=4))
                 for s in samplers]
        done = 0
        while steps is None or done < steps:
            batches = [next(it, None) for it in iters]
            if batches[0] is None:
                break
            for s, batch in zip(samplers, batches, strict=True):
                seen += _rows(batch)
                s.step(len(batch))
            done += 1
        state = samplers[0].state_dict()
        del iters
    counts = Counter(i for i, _ in seen)
    assert set(counts) == set(range(N)) and sum(counts.values()) - N < 3
    # Same position -> same tensor: recompute each sample's augmentation from its position.
    ref = {}
    for r in range(1):
        for key in ElasticDistributedSampler(N, 1, r, seed=4, positions=True):
            ref[key.index] = ds[key].numpy().tobytes()
    assert all(blob == ref[i] for i, blob in seen if counts[i] == 1)


def _write_stream(tmp_path, sizes):
    shards, k = [], 0
    for i, size in enumerate(sizes):
        path = tmp_path / f"shard-{i}.jsonl"
        path.write_text("".join(json.dumps({"id": k + j}) + "\n" for j in range(size)))
        k += size
        shards.append(Shard(f"file://{path}", size))
    return shards


def _stream_segment(shards, state, world, steps):
    ranks = []
    for r in range(world):
        s = ElasticStream(shards, global_batch_size=7, num_replicas=world, rank=r,
                          collate=lambda xs: [x["id"] for x in xs])
        if state is not None:
            s.load_state_dict(state)
        ranks.append((s, iter(DataLoader(s, batch_size=None, num_workers=2, prefetch_factor=4))))
    out = []
    todo = ranks[0][0].steps_remaining if steps is None else steps
    for _ in range(todo):
        out.append(sorted(i for _, it in ranks for i in next(it)))
        for s, _ in ranks:
            s.step()
    state = ranks[0][0].state_dict()
    del ranks
    return out, state


def test_stream_with_workers_resumes_exactly_once(tmp_path):
    """ElasticStream over local JSONL shards, DataLoader(num_workers=2): 2 ranks for 3 steps,
    then 3 to the end, equals one uninterrupted rank, step for step."""
    shards = _write_stream(tmp_path, [10, 0, 17, 4, 9])
    ref, _ = _stream_segment(shards, None, 1, None)
    a, st = _stream_segment(shards, None, 2, 3)
    b, _ = _stream_segment(shards, st, 3, None)
    assert a + b == ref and sorted(i for s in ref for i in s) == list(range(40))
