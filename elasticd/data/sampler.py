"""ElasticSampler: a DistributedSampler whose data order survives world-size changes.

``torch.utils.data.DistributedSampler`` deals indices round-robin by world size, so after a
resize the same epoch position names different samples: some are trained twice, some never.
Here the data order is a function of ``(seed, epoch, position)`` only (DESIGN.md decision 5):

- one global permutation per ``(seed, epoch)`` (:class:`~elasticd.data.permutation.FeistelPermutation`,
  evaluated lazily, O(shard) memory);
- step ``s`` trains the global batch of positions ``[p0 + s*G, p0 + (s+1)*G)``;
- a rank trains a contiguous slice of that global batch (:func:`~elasticd.data.sharding.rank_share`);
- the state is the number of positions *trained* this epoch, advanced by the training loop
  (:meth:`ElasticSampler.step` after the optimizer step), never by DataLoader prefetching.

Load the state at any world size and the sampler continues with the next untrained global
batch. The reference for behaviour (tail rule, small datasets, DataLoader workers) is the
"ElasticSampler" section of docs/worker-api.md.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sized
from itertools import chain
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from elasticd.data.permutation import MAX_DATASET_LEN, PERMUTATION_ALGORITHM, FeistelPermutation
from elasticd.data.sharding import check_split, rank_share, steps_remaining
from elasticd.errors import ConfigError

log = structlog.get_logger(__name__)

STATE_VERSION = 1
"""Version of :meth:`ElasticSampler.state_dict`'s layout."""

# Indices computed per vectorised batch of work (whole steps of this rank's share, at least
# one step). Large enough to amortise torch's per-op overhead (~80 ns/index at 32k versus
# ~350 ns/index at 1k, see docs/benchmarks.md), small enough to be O(1) memory: 32k int64.
_CHUNK_POSITIONS = 32768


def whole_number(what: str, value: Any, *, minimum: int, fix: str) -> int:
    """``value`` as a Python int, or a ConfigError naming ``what``, the value and ``fix``.

    Accepts ints and integer scalars that implement ``__index__`` (NumPy, 0-d tensors), so
    the saved state stays plain JSON. Refuses bools and floats (even 8.0): a fractional
    counter would otherwise be truncated silently.

    Args:
        what: the field's name in the message (``"global_batch_size"``).
        value: what was given.
        minimum: the smallest valid value.
        fix: what to do instead, appended to the message.

    Raises:
        ConfigError: not an integer, or below ``minimum``.
    """
    if isinstance(value, (bool, float)):
        number = None
    else:
        try:
            number = operator.index(value)
        except TypeError:
            number = None
    if number is None:
        raise ConfigError(f"{what} must be a whole number, got {value!r} "
                          f"({type(value).__name__}); {fix}")
    if number < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {number}; {fix}")
    return int(number)


def _flag(what: str, value: Any, fix: str) -> bool:
    numpy_bool = type(value).__module__ == "numpy" and isinstance(getattr(value, "item", int)(), bool)
    if not isinstance(value, bool) and not numpy_bool:
        raise ConfigError(f"{what} must be True or False, got {value!r} ({type(value).__name__}); {fix}")
    return bool(value)


def _world_from_torch(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    return num_replicas, rank


class ElasticSampler(Sampler[int]):
    """Yields this rank's share of each remaining global batch of the current epoch.

    Drop-in for ``DistributedSampler`` plus two duties for the training loop: call
    :meth:`step` once after every optimizer step, and save :meth:`state_dict` with the
    checkpoint::

        sampler = ElasticSampler(dataset, global_batch_size=256, seed=0)
        sampler.load_state_dict(ckpt["sampler"])              # if resuming
        loader = DataLoader(dataset, batch_sampler=ElasticBatchSampler(sampler, plan))
        for epoch in range(sampler.epoch, num_epochs):
            sampler.set_epoch(epoch)                          # keeps a resumed position
            micro_batches = iter(loader)
            for _ in range(sampler.steps_remaining):
                ...                                           # plan.accumulation_steps micro-batches
                optimizer.step()
                sampler.step()                                # this global batch is trained

    Iterating starts at the first untrained position; the iterator does not move the
    trained counter, so DataLoader prefetching (``num_workers > 0``) is harmless.
    """

    def __init__(
        self,
        dataset: Sized | int,
        *,
        global_batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        """Build the sampler for one rank.

        Args:
            dataset: A sized dataset, or its length.
            global_batch_size: Samples per optimizer step over all ranks; constant across
                world sizes (gradient accumulation absorbs the world size, see
                :func:`~elasticd.data.batching.plan_global_batch`).
            num_replicas: World size; default ``torch.distributed``'s if initialised, else 1.
            rank: This rank; default ``torch.distributed``'s if initialised, else 0.
            shuffle: Walk a seeded permutation (True) or positions in order (False).
            seed: Shuffle seed; must be the same on every rank and across restarts.
            drop_last: Drop a partial last global batch (True) or pad it by wrapping to the
                start of the permutation (False).

        Raises:
            ConfigError: Empty or oversized dataset; ``global_batch_size`` < 1 or smaller
                than the world size (a rank would have nothing to train); or
                ``drop_last`` with a global batch larger than the dataset (no step at all);
                or a value of the wrong type (a float batch size, a str seed), named.
            ValueError: ``rank`` outside ``[0, num_replicas)``.
        """
        super().__init__()
        n = whole_number("dataset length", dataset if not isinstance(dataset, Sized) else len(dataset),
                         minimum=0, fix="pass the dataset or its length as an int")
        global_batch_size = whole_number(
            "global_batch_size", global_batch_size, minimum=1,
            fix="pass the number of samples per optimizer step over all ranks as an int, "
                "e.g. global_batch_size=int(cfg.batch)")
        seed = whole_number("seed", seed, minimum=-(2**63),
                            fix="pass an int, the same on every rank and across restarts")
        shuffle = _flag("shuffle", shuffle, "pass shuffle=True or shuffle=False")
        drop_last = _flag("drop_last", drop_last, "pass drop_last=True or drop_last=False")
        if num_replicas is not None:
            num_replicas = whole_number("num_replicas", num_replicas, minimum=1,
                                        fix="pass the world size as an int, or omit it")
        if rank is not None:
            rank = whole_number("rank", rank, minimum=0, fix="pass this rank as an int, or omit it")
        if not 1 <= n <= MAX_DATASET_LEN:
            raise ConfigError(
                f"ElasticSampler needs a dataset of 1 to 2**62 samples, got {n}; "
                "check the dataset path/filters"
            )
        num_replicas, rank = _world_from_torch(num_replicas, rank)
        check_split(global_batch_size, num_replicas)
        if drop_last and global_batch_size > n:
            raise ConfigError(
                f"global_batch_size {global_batch_size} is larger than the dataset ({n} samples) "
                "and drop_last=True drops the partial batch, so no step would ever train; "
                f"use global_batch_size <= {n} or drop_last=False"
            )
        self._offset, self._share = rank_share(global_batch_size, num_replicas, rank)
        self._n = n
        self._global_batch_size = global_batch_size
        self._num_replicas = num_replicas
        self._rank = rank
        self._shuffle = shuffle
        self._seed = seed
        self._drop_last = drop_last
        self._epoch = 0
        self._samples_trained = 0

    # -- read-only view ---------------------------------------------------------------

    @property
    def dataset_len(self) -> int:
        """Samples in the dataset."""
        return self._n

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self._global_batch_size

    @property
    def num_replicas(self) -> int:
        """World size this sampler shards for."""
        return self._num_replicas

    @property
    def rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def shuffle(self) -> bool:
        """Whether positions are mapped through the seeded permutation."""
        return self._shuffle

    @property
    def seed(self) -> int:
        """Shuffle seed."""
        return self._seed

    @property
    def drop_last(self) -> bool:
        """The tail rule: drop (True) or pad (False) a partial last global batch."""
        return self._drop_last

    @property
    def epoch(self) -> int:
        """Current epoch."""
        return self._epoch

    @property
    def samples_trained(self) -> int:
        """Positions of this epoch already trained (padded positions included)."""
        return self._samples_trained

    @property
    def share_size(self) -> int:
        """Samples this rank takes from every global batch (``G // W`` or one more)."""
        return self._share

    @property
    def steps_remaining(self) -> int:
        """Optimizer steps left in the current epoch."""
        return steps_remaining(
            self._n, self._global_batch_size, self._samples_trained, self._drop_last
        )

    # -- training-loop API ------------------------------------------------------------

    def regroup(self, num_replicas: int | None = None, rank: int | None = None) -> None:
        """Shard the remaining global batches for a new world (after a live re-formation).

        Args:
            num_replicas, rank: The new world; default ``torch.distributed``'s.

        Raises:
            ConfigError: the global batch does not split over ``num_replicas`` ranks.
        """
        num_replicas, rank = _world_from_torch(num_replicas, rank)
        check_split(self._global_batch_size, num_replicas)
        self._offset, self._share = rank_share(self._global_batch_size, num_replicas, rank)
        self._num_replicas, self._rank = num_replicas, rank

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate.

        A different epoch starts at position 0; the current epoch keeps its position, so
        after :meth:`load_state_dict` the usual ``for epoch in range(sampler.epoch, E):
        sampler.set_epoch(epoch)`` resumes mid-epoch instead of replaying it.

        Args:
            epoch: Epoch number (``>= 0``).

        Raises:
            ConfigError: ``epoch`` is negative or not a whole number (a state saved after
                it could never be loaded).
        """
        epoch = whole_number("epoch", epoch, minimum=0,
                             fix="epochs count from 0: loop over range(sampler.epoch, num_epochs)")
        if epoch == self._epoch:
            return
        if epoch < self._epoch:
            # Usually a loop written as range(0, E) after a resume: it retrains old epochs.
            log.warning(
                "sampler_epoch_rewound",
                from_epoch=self._epoch,
                to_epoch=epoch,
                hint="iterate epochs from sampler.epoch after load_state_dict",
            )
        self._epoch = epoch
        self._samples_trained = 0

    def step(self, num_steps: int = 1) -> None:
        """Record that ``num_steps`` more global batches were trained (optimizer stepped).

        Call it after ``optimizer.step()``, on every rank, once per global batch; the
        state saved after it resumes at the next global batch.

        Raises:
            ValueError: ``num_steps < 1`` or not a whole number.
            RuntimeError: The epoch has fewer steps left than ``num_steps``, i.e. the loop
                and the sampler disagree about where the epoch ends.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            try:
                num_steps = operator.index(num_steps)
            except TypeError:
                num_steps = 0
            if num_steps < 1:
                raise ValueError(f"num_steps must be a whole number >= 1, got {num_steps!r}")
        left = self.steps_remaining
        if num_steps > left:
            raise RuntimeError(
                f"sampler.step({num_steps}) with {left} step(s) left in epoch {self._epoch}: "
                "call step() once per optimizer step over this sampler's batches, and "
                "set_epoch(next_epoch) before starting the next epoch"
            )
        self._samples_trained += num_steps * self._global_batch_size

    def iter_steps(self) -> Iterator[list[int]]:
        """This rank's share of each remaining global batch, one list per optimizer step.

        Starts at the first untrained position (read now, not at the first ``next()``).
        """
        # chain.from_iterable walks each chunk's list in C: ~30 ns per index less than a
        # nested generator expression.
        return chain.from_iterable(chunk.tolist() for chunk in self._chunks(self._samples_trained))

    def __iter__(self) -> Iterator[int]:
        """This rank's indices for the rest of the epoch, step after step."""
        return chain.from_iterable(
            chunk.reshape(-1).tolist() for chunk in self._chunks(self._samples_trained)
        )

    def __len__(self) -> int:
        """Indices an iteration started now yields (remaining steps x this rank's share)."""
        return self.steps_remaining * self._share

    def _chunks(self, start: int) -> Iterator[torch.Tensor]:
        """Yield ``(steps, share)`` int64 tensors of sample indices, a bounded chunk at a time."""
        steps = steps_remaining(self._n, self._global_batch_size, start, self._drop_last)
        perm = (
            FeistelPermutation(self._n, seed=self._seed, epoch=self._epoch)
            if self._shuffle
            else None
        )
        per_chunk = max(1, _CHUNK_POSITIONS // self._share)
        within = torch.arange(self._share, dtype=torch.int64)
        for first in range(0, steps, per_chunk):
            count = min(per_chunk, steps - first)
            step_starts = (
                start
                + self._offset
                + (first + torch.arange(count, dtype=torch.int64)) * self._global_batch_size
            )
            positions = step_starts[:, None] + within[None, :]
            # Only the padded tail (drop_last=False) runs past n; it wraps to the permutation's start.
            if start + (first + count) * self._global_batch_size > self._n:
                positions = positions % self._n
            yield perm(positions) if perm is not None else positions

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state to save with the checkpoint (same on every rank)."""
        return {
            "version": STATE_VERSION,
            "permutation": PERMUTATION_ALGORITHM,
            "epoch": self._epoch,
            "samples_trained": self._samples_trained,
            "dataset_len": self._n,
            "global_batch_size": self._global_batch_size,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "world_size": self._num_replicas,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved epoch and position, whatever world size saved it.

        The data order must be the one the state was written under: same dataset length,
        seed, shuffle and permutation algorithm. A different global batch size or tail rule
        is accepted (the epoch continues from the same position with the new setting) and
        logged, since it changes which samples the rest of the epoch trains together.

        Raises:
            ConfigError: The state is None or not a mapping, from an unknown version or
                another data order, or a field has the wrong type or range (named, with
                the value; a fractional counter is refused, never truncated).
        """
        if not isinstance(state, Mapping):
            raise ConfigError(
                f"sampler state is {state!r} ({type(state).__name__}), not a dict: the checkpoint "
                "has no sampler entry, or another value was passed; pass the dict saved from "
                "ElasticSampler.state_dict(), or skip load_state_dict to start the epoch afresh")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"sampler state version {state.get('version')!r} is not supported (this elasticd "
                f"reads version {STATE_VERSION}); resume with the elasticd that wrote the checkpoint"
            )
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ConfigError(
                f"sampler state lacks {', '.join(missing)}: it was not written by "
                "ElasticSampler.state_dict(); check which checkpoint entry is passed in"
            )
        fix = (
            "restore the original setting, or start a new epoch without loading the sampler "
            "state (the interrupted epoch's remaining samples are then not trained exactly once)"
        )
        broken = "the state was edited or not written by ElasticSampler.state_dict()"
        whole_number("sampler state dataset_len", state["dataset_len"], minimum=1, fix=broken)
        whole_number("sampler state seed", state["seed"], minimum=-(2**63), fix=broken)
        whole_number("sampler state global_batch_size", state["global_batch_size"], minimum=1,
                     fix=broken)
        for key in ("shuffle", "drop_last"):
            _flag(f"sampler state {key}", state[key], broken)
        if not isinstance(state["permutation"], str):
            raise ConfigError(f"sampler state permutation is {state['permutation']!r}, not a "
                              f"name; {broken}")
        epoch = whole_number("sampler state epoch", state["epoch"], minimum=0, fix=broken)
        trained = whole_number("sampler state samples_trained", state["samples_trained"], minimum=0,
                               fix=broken)
        for key, mine in (
            ("dataset_len", self._n),
            ("seed", self._seed),
            ("shuffle", self._shuffle),
        ):
            if state[key] != mine:
                raise ConfigError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {key}={mine!r}: "
                    f"the saved position names other samples under a different order; {fix}"
                )
        if self._shuffle and state["permutation"] != PERMUTATION_ALGORITHM:
            raise ConfigError(
                f"sampler state was written with permutation {state['permutation']!r}, this "
                f"elasticd computes {PERMUTATION_ALGORITHM!r}; {fix}"
            )
        for key, mine in (
            ("global_batch_size", self._global_batch_size),
            ("drop_last", self._drop_last),
        ):
            if state[key] != mine:
                log.warning("sampler_setting_changed", setting=key, saved=state[key], now=mine)
        self._epoch, self._samples_trained = epoch, trained
        log.info(
            "sampler_state_loaded",
            epoch=epoch,
            samples_trained=trained,
            saved_world_size=state.get("world_size"),
            world_size=self._num_replicas,
            rank=self._rank,
            steps_remaining=self.steps_remaining,
        )
