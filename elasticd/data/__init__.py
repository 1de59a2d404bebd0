"""The data side of the worker API: elastic sampling and a constant global batch.

- :class:`ElasticSampler` — data order as a function of (seed, epoch, position), resumable
  at any world size (DESIGN.md decision 5).
- :func:`plan_global_batch` / :class:`BatchPlan` — micro-batch size and gradient
  accumulation that keep the global batch constant as the world size changes.
- :func:`accumulation_contexts` — DDP ``no_sync()`` on all but the last micro-step.
- :class:`ElasticBatchSampler` — micro-batches aligned with optimizer steps (uneven plans).
- :class:`ElasticDistributedSampler` — ``DistributedSampler``'s signature, per-rank batch
  fixed, exactly-once mid-epoch resume at any world size.
- :mod:`~elasticd.data.positions` — per-sample seeds keyed by (seed, epoch, position):
  :class:`SampleKey`, :class:`PositionedSampler`, :class:`PositionedBatchSampler`,
  :class:`SeededDataset`.
- :class:`ElasticStream` — resumable, reshardable streaming over a list of shards.
- :class:`ElasticStatefulLoader` — torchdata ``StatefulDataLoader`` under elasticd's position.
"""

from elasticd.data.batch_sampler import ElasticBatchSampler
from elasticd.data.batching import BatchPlan, accumulation_contexts, plan_global_batch
from elasticd.data.distributed import ElasticDistributedSampler
from elasticd.data.permutation import FeistelPermutation
from elasticd.data.positions import (
    PositionedBatchSampler,
    PositionedSampler,
    SampleKey,
    SeededDataset,
    sample_generator,
    sample_seed,
)
from elasticd.data.sampler import ElasticSampler
from elasticd.data.stateful import ElasticStatefulLoader
from elasticd.data.stream import ElasticStream, FixedRecordFormat, JsonLinesFormat, Shard

__all__ = [
    "BatchPlan",
    "ElasticBatchSampler",
    "ElasticDistributedSampler",
    "ElasticSampler",
    "ElasticStatefulLoader",
    "ElasticStream",
    "FeistelPermutation",
    "FixedRecordFormat",
    "JsonLinesFormat",
    "PositionedBatchSampler",
    "PositionedSampler",
    "SampleKey",
    "SeededDataset",
    "Shard",
    "accumulation_contexts",
    "plan_global_batch",
    "sample_generator",
    "sample_seed",
]
