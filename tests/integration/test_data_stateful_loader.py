"""torchdata's StatefulDataLoader under ElasticStatefulLoader, with real worker processes.

Same topology: the per-worker dataset state (an RNG inside the dataset) is restored, so the
resumed run continues exactly as an uninterrupted one. Another world size: the loader's
own sampler fields and the dataset states are ignored, the elasticd position decides, and
every sample is trained exactly once.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import torch

from elasticd.data import (
    ElasticBatchSampler,
    ElasticSampler,
    ElasticStatefulLoader,
    plan_global_batch,
)

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError as exc:  # pragma: no cover - torchdata is in the test extra
    pytest.skip(f"torchdata is not installed ({exc}); pip install 'torchdata>=0.11'",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(120)
N, G = 48, 8


class RngDataset(torch.utils.data.Dataset):
    """A legacy stateful dataset: augmentation from a per-worker RNG it checkpoints."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(1)
        self.restored = 0

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        draw = torch.rand((), generator=self.gen, dtype=torch.float64)
        return torch.tensor([i, float(draw), self.restored], dtype=torch.float64)

    def state_dict(self) -> dict:
        return {"rng": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["rng"])
        self.restored = 1


def _loader(world, rank, state=None, workers=2):
    s = ElasticSampler(N, global_batch_size=G, num_replicas=world, rank=rank, seed=2)
    plan = plan_global_batch(G, world, G, allow_uneven=True)
    loader = StatefulDataLoader(RngDataset(), batch_sampler=ElasticBatchSampler(s, plan),
                                num_workers=workers, prefetch_factor=3 if workers else None)
    adapter = ElasticStatefulLoader(loader, s)
    if state is not None:
        adapter.load_state_dict(state)
    return s, adapter


def _train(world, rank, steps, state=None, workers=2):
    s, adapter = _loader(world, rank, state, workers)
    it = iter(adapter)
    out = []
    for _ in range(s.steps_remaining if steps is None else steps):
        out.append(next(it))
        s.step()
    saved = adapter.state_dict()
    del it
    return out, saved


def _through_checkpoint(state: dict) -> dict:
    """Save the adapter's state with CheckpointManager (safe loading) and read it back."""
    from elasticd.checkpoint import CheckpointManager

    url = f"memory://stateful-{uuid.uuid4().hex}"
    with CheckpointManager(url, job="t", rank=0, world_size=1) as mgr:
        mgr.save(1, {"loader": state}, blocking=True)
    with CheckpointManager(url, job="t", rank=0, world_size=1) as mgr:
        loaded = mgr.load_latest()
    assert loaded is not None
    return loaded.state["loader"]


@pytest.mark.parametrize("workers", [2, 0])
def test_same_topology_restores_worker_dataset_state(workers):
    """World 2, rank 1, 2 workers (or none): stopping after 3 steps and resuming (the state
    through a real checkpoint) continues exactly as the uninterrupted run, dataset RNG draws
    included."""
    ref, _ = _train(2, 1, None, workers=workers)
    first, state = _train(2, 1, 3, workers=workers)
    rest, _ = _train(2, 1, None, _through_checkpoint(state), workers=workers)
    assert len(first) + len(rest) == len(ref) == N // G
    for got, want in zip(first + rest, ref, strict=True):
        assert torch.equal(got[:, :2], want[:, :2])
    assert all(b[:, 2].eq(1).all() for b in rest[:2]), "worker dataset state was not restored"


def test_new_world_size_follows_elasticd_position_and_rederives_state():
    """World 2 for 3 steps, then world 3: the loader's own sampler state is not used, every
    sample is trained exactly once, and the dataset states are not restored."""
    seen: list[int] = []
    state = None
    for r in range(2):
        out, st = _train(2, r, 3)
        seen += [int(i) for b in out for i in b[:, 0]]
        state = state or st
    assert state["sampler"]["samples_trained"] == 3 * G
    for r in range(3):
        out, _ = _train(3, r, None, state)
        seen += [int(i) for b in out for i in b[:, 0]]
        assert all(b[:, 2].eq(0).all() for b in out), "dataset state restored across a resize"
    assert Counter(seen) == Counter(range(N))


def test_worker_seeds_are_rederived_from_the_job_state():
    """Without saved states, each worker's RNGs are seeded from (seed, epoch, position,
    rank, worker): two fresh loaders at the same position draw the same numbers."""

    class GlobalRng(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return torch.rand(())

    def draws():
        s = ElasticSampler(N, global_batch_size=G, num_replicas=1, rank=0, seed=5)
        loader = StatefulDataLoader(GlobalRng(), batch_size=4, sampler=s, num_workers=2)
        return torch.cat(list(ElasticStatefulLoader(loader, s)))

    assert torch.equal(draws(), draws())


def test_a_state_taken_before_the_first_iteration_does_not_pin_the_start_position():
    """state_dict() on a fresh adapter (a replica or checkpoint taken at resume) and then a
    load of epoch 1's state: the next iteration yields the rest of epoch 1, not the epoch 0
    batches torchdata's workers prefetched when state_dict() built an iterator."""
    s, adapter = _loader(1, 0)
    s.set_epoch(1)
    it = iter(adapter)
    for _ in range(2):
        next(it)
        s.step()
    saved = adapter.state_dict()
    want = [b[:, 0].tolist() for b in it]
    del it
    s, adapter = _loader(1, 0)
    adapter.state_dict()
    adapter.load_state_dict(saved)
    assert s.epoch == 1
    assert [b[:, 0].tolist() for b in adapter] == want
