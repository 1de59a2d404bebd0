"""ElasticBatchSampler: micro-batches that line up with optimizer steps.

A plain ``DataLoader(batch_size=m)`` over :class:`~elasticd.data.sampler.ElasticSampler`
cuts the index stream every ``m`` samples; that lines up with optimizer steps only when a
rank's share is a multiple of ``m`` (even plans). With uneven plans (``allow_uneven=True``,
world size not dividing the global batch) a micro-batch would straddle two global batches
and the trained counter would be wrong. This batch sampler cuts each step's share into
exactly ``plan.micro_batch_sizes(rank)``, so the DataLoader yields
``plan.accumulation_steps`` batches per optimizer step on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler

from elasticd.data.batching import BatchPlan
from elasticd.data.sampler import ElasticSampler
from elasticd.errors import ConfigError


class ElasticBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches, ``plan.accumulation_steps`` per optimizer step.

    Use as ``DataLoader(dataset, batch_sampler=ElasticBatchSampler(sampler, plan))``. It
    reads the sampler's position when iteration starts and, like the sampler, never moves
    it: the training loop calls ``sampler.step()`` after each optimizer step.
    """

    def __init__(self, sampler: ElasticSampler, plan: BatchPlan) -> None:
        """Pair a sampler with the batch plan for the same global batch and world size.

        Raises:
            ConfigError: The plan was made for another global batch size or world size, or
                ``sampler``/``plan`` is not an ElasticSampler/BatchPlan (named).
        """
        super().__init__()
        if not isinstance(sampler, ElasticSampler):
            raise ConfigError(f"ElasticBatchSampler needs an ElasticSampler, got "
                              f"{type(sampler).__name__}; build one with ElasticSampler(dataset, "
                              "global_batch_size=...)")
        if not isinstance(plan, BatchPlan):
            raise ConfigError(f"ElasticBatchSampler needs a BatchPlan, got {type(plan).__name__}; "
                              "build one with plan_global_batch(global_batch, world_size, micro_batch)")
        if (plan.global_batch_size, plan.world_size) != (
            sampler.global_batch_size,
            sampler.num_replicas,
        ):
            raise ConfigError(
                f"batch plan is for global batch {plan.global_batch_size} at world size "
                f"{plan.world_size}, the sampler for {sampler.global_batch_size} at "
                f"{sampler.num_replicas}; build both from the same values"
            )
        self._sampler = sampler
        self._plan = plan
        self._sizes = plan.micro_batch_sizes(sampler.rank)

    @property
    def sampler(self) -> ElasticSampler:
        """The underlying sampler (call its ``step()`` and ``state_dict()``)."""
        return self._sampler

    @property
    def plan(self) -> BatchPlan:
        """The batch plan the micro-batches follow."""
        return self._plan

    def __iter__(self) -> Iterator[list[int]]:
        """Micro-batches for the rest of the epoch; every step's share is cut the same way."""
        sizes = self._sizes
        for share in self._sampler.iter_steps():
            start = 0
            for size in sizes:
                yield share[start : start + size]
                start += size

    def __len__(self) -> int:
        """Micro-batches an iteration started now yields."""
        return self._sampler.steps_remaining * len(self._sizes)
