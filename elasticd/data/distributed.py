"""ElasticDistributedSampler: torch's ``DistributedSampler`` signature, exactly-once resume.

The adoption path for scripts written for torchrun: same constructor
``(dataset, num_replicas, rank, shuffle, seed, drop_last)``, same ``set_epoch``, and the
per-rank batch stays whatever the DataLoader's ``batch_size`` is, so the global batch
follows the world size as it does under torchrun. What changes is that it can resume in
the middle of an epoch at any world size with every sample trained exactly once.

Why it works without knowing the batch size: from the resume position ``p0`` the remaining
positions are dealt round-robin, as ``DistributedSampler`` does (rank ``r`` takes ``p0 + r,
p0 + r + W, ...``). After ``k`` steps in which every rank trained ``b`` samples, the
trained positions are exactly ``[p0, p0 + k*b*W)``, a prefix: the state is one integer,
and any world size can continue from it. The training loop reports each step's per-rank
sample count with :meth:`ElasticDistributedSampler.step` (``elasticd.worker.ElasticLoop``
does it for you).

Positions map to samples through the same seeded permutation as
:class:`~elasticd.data.sampler.ElasticSampler`, so ``shuffle=True`` orders do not depend
on the world size either, and per-sample seeds (:mod:`elasticd.data.positions`) apply.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import structlog
import torch
from torch.utils.data import Sampler

from elasticd.data.permutation import MAX_DATASET_LEN, PERMUTATION_ALGORITHM, FeistelPermutation
from elasticd.data.positions import SampleKey
from elasticd.data.sampler import _CHUNK_POSITIONS, _world_from_torch
from elasticd.errors import ConfigError

log = structlog.get_logger(__name__)

STATE_KIND = "elasticd.distributed-sampler"
STATE_VERSION = 1


def round_robin_count(remaining: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank takes from ``remaining`` positions dealt round-robin.

    Args:
        remaining: Untrained positions left in the epoch (``>= 0``).
        world_size: Ranks.
        drop_last: Drop the tail that does not divide evenly (True) or pad it by wrapping
            to the start of the epoch's order (False), as ``DistributedSampler`` does.

    Returns:
        The per-rank count, the same on every rank (DDP needs every rank in every step).
    """
    if remaining <= 0:
        return 0
    return remaining // world_size if drop_last else -(-remaining // world_size)


class ElasticDistributedSampler(Sampler[int]):
    """``DistributedSampler`` that resumes mid-epoch exactly once at any world size.

    Drop-in: ``DataLoader(ds, batch_size=32, sampler=ElasticDistributedSampler(ds))``;
    ``set_epoch(epoch)`` as usual. Two duties, which ``elasticd.worker.ElasticLoop``
    performs: call :meth:`step` with the per-rank batch size after every optimizer step,
    and save :meth:`state_dict` with the checkpoint.

    With ``positions=True`` it yields :class:`~elasticd.data.positions.SampleKey` instead of
    ints (for :class:`~elasticd.data.positions.SeededDataset`).
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        positions: bool = False,
    ) -> None:
        """Build the sampler for one rank (arguments as ``DistributedSampler``'s).

        Raises:
            ConfigError: Empty or oversized dataset.
            ValueError: ``rank`` outside ``[0, num_replicas)``.
        """
        super().__init__()
        n = dataset if isinstance(dataset, int) else len(dataset)
        if not 1 <= n <= MAX_DATASET_LEN:
            raise ConfigError(
                f"ElasticDistributedSampler needs a dataset of 1 to 2**62 samples, got {n}; "
                "check the dataset path/filters"
            )
        num_replicas, rank = _world_from_torch(num_replicas, rank)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.dataset_len = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.positions = positions
        self.epoch = 0
        self.samples_trained = 0

    # -- view -------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Samples this rank yields from the trained position to the end of the epoch."""
        return round_robin_count(self.dataset_len - self.samples_trained, self.num_replicas,
                                 self.drop_last)

    @property
    def epoch_done(self) -> bool:
        """True when nothing of the current epoch is left to train."""
        return self.num_samples == 0

    def __len__(self) -> int:
        return self.num_samples

    # -- loop API ---------------------------------------------------------------------

    def regroup(self, num_replicas: int | None = None, rank: int | None = None) -> None:
        """Shard for a new world (after a live re-formation) from the trained position on.

        Args:
            num_replicas, rank: The new world; default ``torch.distributed``'s.

        Raises:
            ValueError: ``rank`` outside ``[0, num_replicas)``.
        """
        num_replicas, rank = _world_from_torch(num_replicas, rank)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.num_replicas, self.rank = num_replicas, rank

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; the current epoch keeps its (possibly resumed) position.

        Raises:
            ValueError: ``epoch < 0``.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.samples_trained = epoch, 0

    def step(self, samples_per_rank: int) -> None:
        """Record one trained step in which every rank trained ``samples_per_rank`` samples.

        Raises:
            ValueError: ``samples_per_rank < 1``.
            RuntimeError: More than this rank has left in the epoch (the loop and the
                sampler disagree about the epoch's end).
        """
        if samples_per_rank < 1:
            raise ValueError(f"samples_per_rank must be >= 1, got {samples_per_rank}")
        left = self.num_samples
        if samples_per_rank > left:
            raise RuntimeError(
                f"sampler.step({samples_per_rank}) with {left} sample(s) per rank left in epoch "
                f"{self.epoch}: report each step's per-rank batch size once, after the optimizer "
                "step, and set_epoch(next_epoch) before the next epoch"
            )
        self.samples_trained += samples_per_rank * self.num_replicas

    def __iter__(self) -> Iterator[Any]:
        """This rank's samples from the trained position (read now) to the end of the epoch."""
        n, w, start = self.dataset_len, self.num_replicas, self.samples_trained
        count = self.num_samples
        perm = FeistelPermutation(n, seed=self.seed, epoch=self.epoch) if self.shuffle else None
        epoch, seed = self.epoch, self.seed
        for first in range(0, count, _CHUNK_POSITIONS):
            j = torch.arange(first, min(count, first + _CHUNK_POSITIONS), dtype=torch.int64)
            positions = start + self.rank + j * w
            wrapped = positions % n  # only the padded tail reaches n
            indices = (perm(wrapped) if perm is not None else wrapped).tolist()
            if self.positions:
                for index, position in zip(indices, positions.tolist(), strict=True):
                    yield SampleKey(index, position, epoch, seed)
            else:
                yield from indices

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (the same on every rank)."""
        return {"kind": STATE_KIND, "version": STATE_VERSION, "permutation": PERMUTATION_ALGORITHM,
                "epoch": self.epoch, "samples_trained": self.samples_trained,
                "dataset_len": self.dataset_len, "seed": self.seed, "shuffle": self.shuffle,
                "world_size": self.num_replicas}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at the saved position, whatever world size saved it.

        Raises:
            ConfigError: Not this sampler's state, another version, or another data order
                (dataset length, seed, shuffle, permutation): the saved position would name
                other samples.
        """
        if not isinstance(state, Mapping) or state.get("kind") != STATE_KIND:
            raise ConfigError(
                "state is not an ElasticDistributedSampler state_dict(); pass the entry the "
                "sampler saved (an ElasticSampler state cannot be loaded here)")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"sampler state version {state.get('version')!r} is not supported "
                              f"(this elasticd reads {STATE_VERSION})")
        for key, mine in (("dataset_len", self.dataset_len), ("seed", self.seed),
                          ("shuffle", self.shuffle)):
            if state.get(key) != mine:
                raise ConfigError(
                    f"sampler state has {key}={state.get(key)!r} but this sampler has {key}={mine!r}; "
                    "restore the original setting (the saved position names other samples otherwise)")
        if self.shuffle and state.get("permutation") != PERMUTATION_ALGORITHM:
            raise ConfigError(f"sampler state uses permutation {state.get('permutation')!r}, this "
                              f"elasticd computes {PERMUTATION_ALGORITHM!r}")
        epoch, trained = int(state["epoch"]), int(state["samples_trained"])
        if epoch < 0 or trained < 0:
            raise ConfigError(f"sampler state has a negative epoch or position: {dict(state)!r}")
        self.epoch, self.samples_trained = epoch, trained
        log.info("sampler_state_loaded", epoch=epoch, samples_trained=trained,
                 saved_world_size=state.get("world_size"), world_size=self.num_replicas,
                 rank=self.rank)
