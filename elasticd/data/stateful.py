"""ElasticStatefulLoader: keep torchdata's ``StatefulDataLoader``, under elasticd's position.

``StatefulDataLoader.state_dict()`` records the loader's own idea of where it is: how many
indices its sampler iterator yielded, the sampler's state as of the last *prefetch*, and
each DataLoader worker's dataset state. Loaded as is after a resize, those sampler fields
are wrong twice: they count batches read ahead rather than trained, and they were computed
for another world size. (With an :class:`~elasticd.data.sampler.ElasticSampler` inside,
``load_state_dict`` would also roll the sampler back to its prefetch-time position.)

So the adapter never hands the loader its own state back:

- the elasticd sampler's trained position is the authority, saved and loaded by the
  adapter (and only advanced by ``sampler.step()``);
- the per-worker dataset states (``Stateful`` datasets: an RNG, a buffer cursor) are
  restored only when the topology matches, ``(world size, rank, num_workers)``; each new
  worker ``i`` takes the state of the worker that would have produced the next batch in an
  uninterrupted run, so the continuation is identical;
- otherwise they are re-derived from the seed: every worker seeds ``torch``, ``random``
  (and numpy, if installed) from ``(seed, epoch, trained position, rank, worker id)``, a
  pure function of the job's state, and its dataset is not loaded.

The worker seeding and state restore run in the DataLoader's ``worker_init_fn`` (the
user's own function, if any, runs first).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

import structlog
import torch
from torch.utils.data import get_worker_info

from elasticd.data.positions import sample_seed
from elasticd.errors import ConfigError

log = structlog.get_logger(__name__)

STATE_KIND = "elasticd.stateful-loader"
STATE_VERSION = 1
# Position tag for worker seeds: far above any sample position, so a worker's seed never
# equals a sample's seed.
_WORKER_TAG = 1 << 62


def worker_seed(seed: int, epoch: int, position: int, rank: int, worker_id: int) -> int:
    """The seed of DataLoader worker ``worker_id`` of ``rank`` starting at ``position``."""
    return sample_seed(seed ^ (rank << 20) ^ worker_id, epoch, _WORKER_TAG + position)


class _WorkerInit:
    """Picklable ``worker_init_fn``: user hook, then restore or re-derive the worker."""

    def __init__(self, user_fn: Any) -> None:
        self.user_fn = user_fn
        self.seeds: list[int] = []
        self.states: list[Any] | None = None

    def __call__(self, worker_id: int) -> None:
        if self.user_fn is not None:
            self.user_fn(worker_id)
        if self.seeds:
            s = self.seeds[worker_id]
            torch.manual_seed(s)
            random.seed(s)
            try:
                import numpy as np

                np.random.seed(s % (1 << 32))
            except ImportError:  # numpy is optional for this
                pass
        if self.states is not None and self.states[worker_id] is not None:
            info = get_worker_info()
            assert info is not None
            dataset: Any = info.dataset
            dataset.load_state_dict(self.states[worker_id])


class ElasticStatefulLoader:
    """A ``StatefulDataLoader`` whose resume follows the elasticd sampler.

    Iterate it like the loader; put it in the checkpoint state instead of the loader
    (``{"loader": adapter, ...}``: it saves the sampler too, so do not also save the sampler).

    Args:
        loader: A ``torchdata.stateful_dataloader.StatefulDataLoader`` built over an
            ``ElasticSampler`` (``sampler=``), an ``ElasticBatchSampler`` or a positioned
            wrapper of either (``batch_sampler=``), with ``snapshot_every_n_steps=1``
            (the default) so that worker dataset states match the last yielded batch.
        sampler: That ``ElasticSampler`` (the authority for the position).

    Raises:
        ConfigError: The loader snapshots less than every step.
    """

    def __init__(self, loader: Any, sampler: Any) -> None:
        if getattr(loader, "snapshot_every_n_steps", 1) != 1:
            raise ConfigError(
                f"StatefulDataLoader(snapshot_every_n_steps={loader.snapshot_every_n_steps}): the "
                "saved worker dataset states would lag the trained position; use the default 1")
        self.loader = loader
        self.sampler = sampler
        self._init = _WorkerInit(loader.worker_init_fn)
        loader.worker_init_fn = self._init
        self._pending: list[Any] | None = None
        self._pending_main: Any = None

    @property
    def topology(self) -> dict[str, int]:
        """What saved dataset states depend on."""
        return {"world_size": int(self.sampler.num_replicas), "rank": int(self.sampler.rank),
                "num_workers": int(self.loader.num_workers)}

    def __iter__(self) -> Iterator[Any]:
        """A fresh loader iterator from the sampler's trained position."""
        workers = self.loader.num_workers
        s = self.sampler
        self._init.seeds = [worker_seed(s.seed, s.epoch, s.samples_trained, s.rank, w)
                            for w in range(workers)]
        self._init.states, self._pending = self._pending, None
        if self._pending_main is not None:
            self.loader.dataset.load_state_dict(self._pending_main)
            self._pending_main = None
        # StatefulDataLoader.state_dict() before any iteration (a replica or checkpoint taken
        # at resume) builds an iterator, whose DataLoader workers prefetch at once from the
        # sampler's position *then*; the next iter() hands that iterator back even after
        # load_state_dict() moved the sampler (another epoch's batches, trained as this
        # one's). Loading an empty state drops it, so this iterator starts from the position now.
        self.loader.load_state_dict({})
        try:
            return iter(self.loader)
        finally:
            self._init.states = None  # used by this iterator's workers only (they fork now)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state, the topology, and the dataset state of each worker (as of
        the last batch the loader yielded)."""
        raw = self.loader.state_dict()
        datasets: list[Any] | None = None
        main: Any = None
        if self.loader.num_workers > 0:
            snap = raw.get("_snapshot") or {}
            workers = snap.get("_worker_snapshots") or {}
            last = snap.get("_last_yielded_worker_id")
            states = [(workers.get(f"worker_{w}") or {}).get("dataset_state")
                      for w in range(self.loader.num_workers)]
            if last is not None and any(x is not None for x in states):
                # New worker i produces the batch that saved worker (last + 1 + i) would have.
                n = len(states)
                datasets = [states[(last + 1 + i) % n] for i in range(n)]
        else:
            main = raw.get("dataset_state")
        return {"kind": STATE_KIND, "version": STATE_VERSION, "sampler": self.sampler.state_dict(),
                "topology": self.topology, "worker_datasets": datasets, "main_dataset": main}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the sampler's position; restore dataset states only on the same topology.

        Raises:
            ConfigError: Not this adapter's state (the sampler's own checks apply too).
        """
        if not isinstance(state, Mapping) or state.get("kind") != STATE_KIND:
            raise ConfigError("state is not an ElasticStatefulLoader state_dict(); do not pass "
                              "StatefulDataLoader.state_dict() here")
        self.sampler.load_state_dict(state["sampler"])
        same = dict(state.get("topology") or {}) == self.topology
        if same:
            self._pending = state.get("worker_datasets")
            self._pending_main = state.get("main_dataset")
        else:
            self._pending, self._pending_main = None, None
        log.info("loader_state_loaded", dataset_states="restored" if same else "rederived",
                 saved_topology=state.get("topology"), topology=self.topology)
