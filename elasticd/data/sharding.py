"""Sampler arithmetic: which slice of a global batch a rank takes, and how long an epoch is.

Pure functions of integers, shared by :class:`~elasticd.data.sampler.ElasticSampler` and
:class:`~elasticd.data.batching.BatchPlan` so that the sampler and the loss scaling can
never disagree on a rank's share.

Vocabulary: an epoch is a stream of *positions* ``0, 1, 2, ...``; position ``p`` holds
sample ``perm[p mod n]`` (the modulo only matters for the padded tail). Step ``s`` of a
sampler that starts at position ``p0`` trains positions ``[p0 + s*G, p0 + (s+1)*G)``.
"""

from __future__ import annotations

from elasticd.errors import ConfigError


def rank_share(global_batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """The contiguous slice of every global batch that ``rank`` trains.

    The first ``G mod W`` ranks take one sample more than the others, so the shares tile
    the global batch exactly: whatever the world size, a step trains the same set of
    positions.

    Args:
        global_batch_size: Samples per optimizer step over all ranks (``G``).
        world_size: Number of ranks (``W``).
        rank: This rank, ``0 <= rank < W``.

    Returns:
        ``(offset, length)`` within the global batch.

    Raises:
        ValueError: ``rank`` is outside ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    base, extra = divmod(global_batch_size, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def steps_remaining(
    dataset_len: int, global_batch_size: int, position: int, drop_last: bool
) -> int:
    """Global batches left in the epoch when the next untrained position is ``position``.

    With ``drop_last`` a global batch is trained only if all of it lies within the first
    ``n`` positions (a partial tail is dropped); without it the last global batch is
    completed by wrapping around to the start of the permutation (padding).

    Args:
        dataset_len: Samples in the dataset (``n``).
        global_batch_size: ``G``.
        position: Positions already trained this epoch (``>= 0``).
        drop_last: The tail rule.

    Returns:
        The number of optimizer steps left this epoch (0 when the epoch is done).
    """
    left = dataset_len - position
    if left <= 0:
        return 0
    if drop_last:
        return left // global_batch_size
    return -(-left // global_batch_size)


def check_split(global_batch_size: int, world_size: int) -> None:
    """Refuse a global batch that would leave some rank with nothing to train.

    DDP's gradient all-reduce needs every rank in every step; a rank with an empty share
    would either hang its peers or have to fake a batch. We refuse instead.

    Raises:
        ConfigError: ``global_batch_size < 1``, ``world_size < 1``, or
            ``global_batch_size < world_size``.
    """
    if global_batch_size < 1:
        raise ConfigError(
            f"global_batch_size must be >= 1, got {global_batch_size}; "
            "set it to the number of samples per optimizer step over all ranks"
        )
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if global_batch_size < world_size:
        raise ConfigError(
            f"global_batch_size {global_batch_size} is smaller than the world size {world_size}: "
            f"ranks {global_batch_size}..{world_size - 1} would have no sample to train in a step, "
            "and DDP needs every rank in every step. World sizes that work with this "
            f"global batch: 1..{global_batch_size}; or use a global batch of at least "
            f"{world_size} (at least the largest world size the job may reach)"
        )
