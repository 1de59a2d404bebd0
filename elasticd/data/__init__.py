"""The data side of the worker API: elastic sampling and a constant global batch.

- :class:`ElasticSampler` — data order as a function of (seed, epoch, position), resumable
  at any world size (DESIGN.md decision 5).
- :func:`plan_global_batch` / :class:`BatchPlan` — micro-batch size and gradient
  accumulation that keep the global batch constant as the world size changes.
- :func:`accumulation_contexts` — DDP ``no_sync()`` on all but the last micro-step.
- :class:`ElasticBatchSampler` — micro-batches aligned with optimizer steps (uneven plans).
"""

from elasticd.data.batch_sampler import ElasticBatchSampler
from elasticd.data.batching import BatchPlan, accumulation_contexts, plan_global_batch
from elasticd.data.permutation import FeistelPermutation
from elasticd.data.sampler import ElasticSampler

__all__ = [
    "BatchPlan",
    "ElasticBatchSampler",
    "ElasticSampler",
    "FeistelPermutation",
    "accumulation_contexts",
    "plan_global_batch",
]
