"""ElasticBatchSampler: micro-batches that line up with optimizer steps.

A plain ``DataLoader(batch_size=m)`` over :class:`~elasticd.data.sampler.ElasticSampler`
cuts the index stream every ``m`` samples; that lines up with optimizer steps only when a
rank's share is a multiple of ``m`` (even plans). With uneven plans (``allow_uneven=True``,
world size not dividing the global batch) a micro-batch would straddle two global batches
and the trained counter would be wrong. This batch sampler cuts each step's share into
exactly ``plan.micro_batch_sizes(rank)``, so the DataLoader yields
``plan.accumulation_steps`` batches per optimizer step on every rank.

A plan is made for one world size. After a live re-formation the sampler is resharded
(``regroup``) and this batch sampler re-plans the same global batch for the new world at
its next iteration (:meth:`~elasticd.data.batching.BatchPlan.for_world`): cutting the new,
larger share with the old plan would train only part of it while the sampler counts all
of it. Read the plan in the loop body as ``batch_sampler.plan`` (its ``loss_scale`` and
``accumulation_steps`` change with the world), not from a variable set at start.
"""

from __future__ import annotations

from collections.abc import Iterator

import structlog
from torch.utils.data import Sampler

from elasticd.data.batching import BatchPlan
from elasticd.data.sampler import ElasticSampler
from elasticd.errors import ConfigError

log = structlog.get_logger(__name__)


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
        self._rank = sampler.rank
        self._sizes = plan.micro_batch_sizes(sampler.rank)

    @property
    def sampler(self) -> ElasticSampler:
        """The underlying sampler (call its ``step()`` and ``state_dict()``)."""
        return self._sampler

    @property
    def plan(self) -> BatchPlan:
        """The batch plan for the sampler's current world (re-planned after a resize).

        Raises:
            ConfigError: the global batch cannot be planned for the new world size (see
                :meth:`~elasticd.data.batching.BatchPlan.for_world`).
        """
        return self._follow_sampler()

    def _follow_sampler(self) -> BatchPlan:
        world, rank = self._sampler.num_replicas, self._sampler.rank
        if (world, rank) != (self._plan.world_size, self._rank):
            old = self._plan
            self._plan, self._rank = old.for_world(world), rank
            self._sizes = self._plan.micro_batch_sizes(rank)
            log.info("batch_plan_replanned", world_size=world, rank=rank,
                     old_world_size=old.world_size, reason=self._plan.reason)
        return self._plan

    def __iter__(self) -> Iterator[list[int]]:
        """Micro-batches for the rest of the epoch; every step's share is cut the same way."""
        self._follow_sampler()
        sizes = self._sizes
        for share in self._sampler.iter_steps():
            start = 0
            for size in sizes:
                yield share[start : start + size]
                start += size

    def __len__(self) -> int:
        """Micro-batches an iteration started now yields."""
        return self._sampler.steps_remaining * self.plan.accumulation_steps
