"""Per-sample randomness that survives any resize: seeds keyed by (seed, epoch, position).

Random augmentation usually draws from a per-process RNG (torch's global generator, or
a DataLoader worker's seed). Which process draws for a sample depends on the world size,
the rank, the DataLoader worker and the restart count, so after a resize or a restart the
same sample gets a different crop/noise/mask, and the run is no longer reproducible. Here a
sample's randomness is a function of ``(job seed, epoch, global position)`` only, the same
key that fixes the data order (DESIGN.md decision 5): whoever trains position ``p`` of epoch
``e`` draws the same numbers.

- :func:`sample_seed` / :func:`sample_generator`: the seed (a 64-bit int) and a fresh
  ``torch.Generator`` for one position.
- :class:`SampleKey`: what the sampler hands the dataset instead of a bare index:
  ``(index, position, epoch, seed)``, a picklable NamedTuple (it crosses into DataLoader
  worker processes).
- :class:`PositionedSampler` / :class:`PositionedBatchSampler`: wrap an
  :class:`~elasticd.data.sampler.ElasticSampler` (or its batch sampler) and yield keys.
- :class:`SeededDataset`: wraps a map-style dataset and a ``transform(item, generator)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset, Sampler

from elasticd.data.batch_sampler import ElasticBatchSampler
from elasticd.data.permutation import FeistelPermutation, _splitmix64
from elasticd.data.sampler import _CHUNK_POSITIONS, ElasticSampler
from elasticd.data.sharding import rank_share, steps_remaining

_MASK64 = 0xFFFFFFFFFFFFFFFF
# Domain tag so that sample seeds never coincide with the permutation's round keys,
# which are derived from the same (seed, epoch) by the same mixer.
_SAMPLE_DOMAIN = 0x5EED_5A3F_1E00_0001


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The augmentation seed of one sample position: a well-mixed 63-bit integer.

    Args:
        seed: The job's seed (the sampler's ``seed``).
        epoch: The epoch.
        position: The sample's global position in the epoch (not its dataset index: a
            padded position that names a sample a second time gets another seed).

    Returns:
        An int in ``[0, 2**63)``, a pure function of the arguments.
    """
    state = _splitmix64((seed & _MASK64) ^ _SAMPLE_DOMAIN)
    state = _splitmix64(state ^ (epoch & _MASK64))
    # 63 bits: fits torch's int64 seeds and numpy's SeedSequence without sign surprises.
    return _splitmix64(state ^ (position & _MASK64)) >> 1


def sample_generator(seed: int, epoch: int, position: int, device: str = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` seeded with :func:`sample_seed` (about 2 us on CPU).

    Args:
        seed: The job's seed.
        epoch: The epoch.
        position: The sample's global position.
        device: Device of the generator (``"cpu"`` in DataLoader workers).

    Returns:
        The generator; draw the sample's augmentation from it and nothing else.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(sample_seed(seed, epoch, position))
    return gen


class SampleKey(NamedTuple):
    """What a positioned sampler yields: the dataset index and where it sits in the epoch.

    Attributes:
        index: Index into the dataset (``dataset[key.index]``).
        position: Global position in the epoch (what the seed is keyed on).
        epoch: The epoch.
        seed: The job's seed.
    """

    # Shadows tuple.index(), on purpose: ``key.index`` is what a dataset indexes with.
    index: int  # type: ignore[assignment]
    position: int
    epoch: int
    seed: int

    @property
    def sample_seed(self) -> int:
        """:func:`sample_seed` of this position."""
        return sample_seed(self.seed, self.epoch, self.position)

    def generator(self, device: str = "cpu") -> torch.Generator:
        """:func:`sample_generator` of this position."""
        return sample_generator(self.seed, self.epoch, self.position, device)


def iter_step_positions(sampler: ElasticSampler) -> Iterator[tuple[list[int], list[int]]]:
    """This rank's ``(indices, positions)`` for each remaining step of the current epoch.

    Mirrors the sampler's own arithmetic (same start, shares, tail rule and permutation),
    read from its public properties, so it yields exactly ``sampler.iter_steps()`` plus
    the positions. Like the sampler it starts at the trained position read now.
    """
    n, g = sampler.dataset_len, sampler.global_batch_size
    start = sampler.samples_trained
    offset, share = rank_share(g, sampler.num_replicas, sampler.rank)
    steps = steps_remaining(n, g, start, sampler.drop_last)
    perm = FeistelPermutation(n, seed=sampler.seed, epoch=sampler.epoch) if sampler.shuffle else None
    per_chunk = max(1, _CHUNK_POSITIONS // share)
    within = torch.arange(share, dtype=torch.int64)
    for first in range(0, steps, per_chunk):
        count = min(per_chunk, steps - first)
        starts = start + offset + (first + torch.arange(count, dtype=torch.int64)) * g
        positions = starts[:, None] + within[None, :]
        wrapped = positions % n  # only the padded tail (drop_last=False) reaches n
        indices = perm(wrapped) if perm is not None else wrapped
        yield from zip(indices.tolist(), positions.tolist(), strict=True)


class PositionedSampler(Sampler[SampleKey]):
    """An :class:`ElasticSampler` that yields :class:`SampleKey` instead of bare indices.

    Use it where the sampler went: ``DataLoader(SeededDataset(ds, aug), sampler=
    PositionedSampler(sampler), batch_size=m)``; keep calling ``sampler.step()`` and saving
    ``sampler.state_dict()`` as before (this wrapper has no state of its own).
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__()
        self.sampler = sampler

    def __iter__(self) -> Iterator[SampleKey]:
        """Keys for the rest of the epoch, step after step."""
        s = self.sampler
        epoch, seed = s.epoch, s.seed
        for indices, positions in iter_step_positions(s):
            for index, position in zip(indices, positions, strict=True):
                yield SampleKey(index, position, epoch, seed)

    def __len__(self) -> int:
        return len(self.sampler)


class PositionedBatchSampler(Sampler[list[SampleKey]]):
    """An :class:`ElasticBatchSampler` whose micro-batches are lists of :class:`SampleKey`.

    ``DataLoader(SeededDataset(ds, aug), batch_sampler=PositionedBatchSampler(
    ElasticBatchSampler(sampler, plan)), num_workers=4)``: micro-batches line up with
    optimizer steps exactly as with the wrapped batch sampler.
    """

    def __init__(self, batch_sampler: ElasticBatchSampler) -> None:
        super().__init__()
        self.batch_sampler = batch_sampler
        self.sampler = batch_sampler.sampler

    def __iter__(self) -> Iterator[list[SampleKey]]:
        """Micro-batches of keys for the rest of the epoch."""
        s = self.sampler
        sizes = self.batch_sampler.plan.micro_batch_sizes(s.rank)
        epoch, seed = s.epoch, s.seed
        for indices, positions in iter_step_positions(s):
            keys = [SampleKey(i, p, epoch, seed) for i, p in zip(indices, positions, strict=True)]
            start = 0
            for size in sizes:
                yield keys[start:start + size]
                start += size

    def __len__(self) -> int:
        return len(self.batch_sampler)


class SeededDataset(Dataset[Any]):
    """A map-style dataset indexed by :class:`SampleKey`: ``transform(item, generator)``.

    ``dataset[key]`` loads ``base[key.index]`` and passes it with the key's generator to
    ``transform``, so the augmentation of a sample depends on its (seed, epoch, position)
    only, not on the process or DataLoader worker that happens to load it.

    Args:
        base: The map-style dataset.
        transform: ``transform(item, generator) -> sample``; it must draw its randomness from
            ``generator`` only (``torch.rand(..., generator=g)``; for numpy or ``random``,
            seed them from ``int(torch.randint(2**62, (1,), generator=g))``).
    """

    def __init__(self, base: Any, transform: Callable[[Any, torch.Generator], Any]) -> None:
        self.base = base
        self.transform = transform

    def __getitem__(self, key: SampleKey) -> Any:
        """The transformed sample at ``key``; a bare int is refused (no position, no seed)."""
        if not isinstance(key, SampleKey):
            raise TypeError(
                f"SeededDataset needs a SampleKey (index, position, epoch, seed), got {key!r}: "
                "wrap the sampler in PositionedSampler or PositionedBatchSampler"
            )
        return self.transform(self.base[key.index], key.generator())

    def __len__(self) -> int:
        return len(self.base)
