"""Constant global batch: split one optimizer step's samples over any world size.

When the world shrinks from 8 to 6 ranks, the optimizer should still see the gradient of
the same global batch, or the learning-rate schedule and the trained model drift from a
run without failures. :func:`plan_global_batch` turns ``(global batch, world size, memory
limit per micro-batch)`` into micro-batch sizes and a number of gradient-accumulation
steps; :func:`accumulation_contexts` runs the accumulation under DDP's ``no_sync()`` so
gradients are all-reduced once per optimizer step; :meth:`BatchPlan.loss_scale` keeps the
gradient equal to the mean over the global batch even when ranks' shares are uneven.

Gradient arithmetic (DDP averages gradients over the ``W`` ranks): a micro-batch of ``k``
samples whose loss is the mean over those samples is multiplied by ``k * W / G``; summed
over a rank's micro-batches and averaged over ranks that is exactly
``(1/G) * sum of per-sample gradients``. With equal micro-batches ``k * W / G`` is
``1 / accumulation_steps``, the familiar rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from elasticd.data.sharding import check_split, rank_share
from elasticd.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How one global batch is trained at one world size.

    Attributes:
        global_batch_size: Samples per optimizer step over all ranks (``G``).
        world_size: Ranks (``W``).
        micro_batch_size: The largest micro-batch any rank runs (the memory bound).
        accumulation_steps: Forward/backward passes per optimizer step, the same on every
            rank (DDP needs every rank in every gradient all-reduce).
        reason: Why this split, in words (for logs and error reports).
        max_micro_batch: The memory bound it was planned under (0: unknown, then
            ``micro_batch_size`` stands for it in :meth:`for_world`).
        allow_uneven: Whether shares may differ by one sample (``plan_global_batch``'s flag).
    """

    global_batch_size: int
    world_size: int
    micro_batch_size: int
    accumulation_steps: int
    reason: str
    max_micro_batch: int = 0
    allow_uneven: bool = False

    def for_world(self, world_size: int) -> BatchPlan:
        """The same global batch, memory bound and tail rule planned for ``world_size`` ranks.

        A plan is bound to the world size it was made for; after a live re-formation the
        loop's batch sampler re-plans with this (itself if ``world_size`` is unchanged).

        Raises:
            ConfigError: as :func:`plan_global_batch` (e.g. an even plan whose global batch
                does not split over ``world_size``: the message names ``allow_uneven=True``).
        """
        if world_size == self.world_size:
            return self
        return plan_global_batch(self.global_batch_size, world_size,
                                 self.max_micro_batch or self.micro_batch_size,
                                 allow_uneven=self.allow_uneven)

    @property
    def even(self) -> bool:
        """True if every micro-batch on every rank has ``micro_batch_size`` samples."""
        return (
            self.micro_batch_size * self.accumulation_steps * self.world_size
            == self.global_batch_size
        )

    def share(self, rank: int) -> int:
        """Samples ``rank`` trains per optimizer step (``G // W`` or one more)."""
        return rank_share(self.global_batch_size, self.world_size, rank)[1]

    def micro_batch_sizes(self, rank: int) -> tuple[int, ...]:
        """Sizes of ``rank``'s micro-batches in one optimizer step, larger ones first.

        They sum to :meth:`share` and differ by at most one sample.
        """
        base, extra = divmod(self.share(rank), self.accumulation_steps)
        return tuple(base + (1 if i < extra else 0) for i in range(self.accumulation_steps))

    def loss_scale(self, num_samples: int) -> float:
        """Factor for the mean loss of a micro-batch of ``num_samples`` samples.

        ``loss.mean() * plan.loss_scale(len(batch))`` makes the all-reduced gradient the
        mean over the global batch whatever the world size or share sizes. Equals
        ``1 / accumulation_steps`` for an even plan.
        """
        return num_samples * self.world_size / self.global_batch_size


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _divisors(value: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(value) + 1) if value % d == 0]
    return sorted(set(small + [value // d for d in small]))


def _uneven_hint(global_batch_size: int, world_size: int) -> str:
    lower = (global_batch_size // world_size) * world_size
    batches = [b for b in (lower, lower + world_size) if b >= world_size]
    near = sorted(_divisors(global_batch_size), key=lambda d: (abs(d - world_size), d))[:8]
    return (
        f"global batch sizes that split evenly over {world_size} ranks: "
        f"{' or '.join(map(str, batches))}; world sizes that split {global_batch_size} evenly: "
        f"{', '.join(map(str, sorted(near)))}; or pass allow_uneven=True to let ranks take "
        f"{global_batch_size // world_size + 1} or {global_batch_size // world_size} samples "
        "(see docs/worker-api.md, 'Constant global batch')"
    )


def plan_global_batch(
    global_batch_size: int,
    world_size: int,
    max_micro_batch: int,
    *,
    allow_uneven: bool = False,
) -> BatchPlan:
    """Split a constant global batch over ``world_size`` ranks with gradient accumulation.

    Default (even) plans satisfy ``micro_batch_size * accumulation_steps * world_size ==
    global_batch_size`` with the fewest accumulation steps whose micro-batch fits
    ``max_micro_batch``. With ``allow_uneven`` any global batch >= world size is trained
    exactly, with the fewest accumulation steps that fit the largest share: shares differ
    by at most one sample between ranks, and micro-batches by at most one within a rank
    (so a share of 127 with ``max_micro_batch=64`` runs 64 + 63 instead of 127 x 1). Uneven plans need :class:`~elasticd.data.batch_sampler.ElasticBatchSampler`
    (shares are not multiples of one micro-batch size) and :meth:`BatchPlan.loss_scale`.

    Args:
        global_batch_size: Samples per optimizer step over all ranks.
        world_size: Ranks in the current round.
        max_micro_batch: Most samples one forward/backward may take (memory bound).
        allow_uneven: Accept shares that differ by one sample instead of raising.

    Returns:
        The plan; ``plan.reason`` says why it was chosen.

    Raises:
        ConfigError: A size is < 1; the global batch is smaller than the world size; or it
            is not divisible by the world size and ``allow_uneven`` is False (the message
            lists global batch sizes and world sizes that do split); or an uneven plan
            would give some rank an empty micro-batch (``max_micro_batch == 1``).
    """
    check_split(global_batch_size, world_size)
    if max_micro_batch < 1:
        raise ConfigError(f"max_micro_batch must be >= 1, got {max_micro_batch}")
    share, extra = divmod(global_batch_size, world_size)
    largest = share + (1 if extra else 0)
    fewest = -(-largest // max_micro_batch)
    if not allow_uneven:
        if extra:
            raise ConfigError(
                f"global batch {global_batch_size} cannot be split evenly over world size "
                f"{world_size} ({global_batch_size} / {world_size} = "
                f"{global_batch_size / world_size:.2f}); "
                + _uneven_hint(global_batch_size, world_size)
            )
        # Fewest accumulation steps = the largest divisor of the share that fits in memory.
        micro = max(d for d in _divisors(share) if d <= max_micro_batch)
        accum = share // micro
        reason = (
            f"{global_batch_size} = {_count(world_size, 'rank')} x {_count(accum, 'micro-step')} "
            f"x {_count(micro, 'sample')}"
        )
        if accum > fewest:
            reason += (
                f"; {share} samples per rank have no divisor between {micro + 1} and "
                f"{max_micro_batch}, so {accum} micro-steps instead of {fewest} "
                f"(allow_uneven=True would run {fewest} micro-steps of unequal size)"
            )
        return BatchPlan(global_batch_size, world_size, micro, accum, reason, max_micro_batch)
    if fewest > share:
        raise ConfigError(
            f"global batch {global_batch_size} over world size {world_size} with "
            f"max_micro_batch {max_micro_batch}: ranks with {_count(share, 'sample')} would need an "
            f"empty micro-batch to match the {fewest} micro-steps of ranks with {largest}; "
            "use max_micro_batch >= 2 or a global batch divisible by the world size"
        )
    micro = -(-largest // fewest)
    shares = (
        f"{_count(extra, 'rank')} x {largest} + {_count(world_size - extra, 'rank')} x {share}"
        if extra
        else f"{_count(world_size, 'rank')} x {share}"
    )
    reason = (
        f"{global_batch_size} = {shares} samples, {_count(fewest, 'micro-step')} of at most {micro}"
    )
    plan = BatchPlan(global_batch_size, world_size, micro, fewest, reason, max_micro_batch,
                     allow_uneven=True)
    if not plan.even:
        plan = dataclasses.replace(
            plan, reason=reason + "; unequal micro-batches, loss scaled per micro-batch"
        )
    return plan


def accumulation_contexts(
    model: Any, steps: BatchPlan | int
) -> Iterator[contextlib.AbstractContextManager[Any]]:
    """One context manager per micro-step: ``model.no_sync()`` for all but the last.

    Gradients of the no_sync micro-steps accumulate locally; the last backward pass
    all-reduces the sum once. Without it DDP would all-reduce after every micro-step
    (``accumulation_steps`` times the traffic for the same result). A model without
    ``no_sync`` (not wrapped in DDP, or world size 1) gets null contexts. Usage::

        for ctx in accumulation_contexts(ddp_model, plan):
            x, y = next(micro_batches)
            with ctx:
                loss = loss_fn(ddp_model(x), y) * plan.loss_scale(len(x))
                loss.backward()
        optimizer.step(); optimizer.zero_grad(); sampler.step()

    Args:
        model: The DDP-wrapped model (anything with ``no_sync()``), an FSDP2 model
            (``set_requires_gradient_sync``), or a plain module.
        steps: The plan, or its number of accumulation steps.

    Yields:
        Context managers to enter around each micro-step's forward and backward.

    Raises:
        ValueError: ``steps`` < 1.
    """
    count = steps.accumulation_steps if isinstance(steps, BatchPlan) else steps
    if count < 1:
        raise ValueError(f"accumulation steps must be >= 1, got {count}")
    no_sync = getattr(model, "no_sync", None)
    # FSDP2 (fully_shard) has no no_sync: gradient sync is a switch on the module.
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    for i in range(count):
        if set_sync is not None:
            set_sync(i == count - 1)  # reduce-scatter once, after the last micro-step
            yield contextlib.nullcontext()
        elif no_sync is not None and i < count - 1:
            yield no_sync()
        else:
            yield contextlib.nullcontext()
