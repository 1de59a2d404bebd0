"""ElasticLoop: resume, per-step bookkeeping, drain and checkpoints in one object.

What a torchrun script needs to become elastic is always the same four duties: load the
newest checkpoint at start (model, optimizer, sampler position, RNG), tell the sampler
after every optimizer step how much was trained, stop at the same step on every rank when
a node is drained (and save that step), and checkpoint through the agent's fence now and
then. ``ElasticLoop`` does all four around the script's own loop, so the change is a few
lines (docs/worker-api.md opens with the diff of the PyTorch DDP tutorial)::

    loop = ElasticLoop({"model": model, "optimizer": optimizer}, train_data.sampler)
    first_epoch = loop.resume()
    for epoch in range(first_epoch, max_epochs):
        train_data.sampler.set_epoch(epoch)
        for source, targets in loop.batches(train_data):
            ...                                   # forward, backward, optimizer.step()

``loop.batches`` yields the loader's batches; when the loop body has finished with one (the
generator is resumed), that batch counts as trained. Prefetched batches never count.

Live re-formation (``ElasticLoop(..., live=True)``, under an agent with
``workers.live_reform``, the default): wrap the model with ``loop.ddp(model)`` instead of
``DDP(model)`` and the step with ``with loop.guard():``.
On a membership change (a node killed, frozen, drained or joining) the workers then keep
their state in memory: the group re-forms in place, a rank that is behind or new gets the
newest state from a peer, the sampler reshards for the new world, the DDP wrapper is
rebuilt on the new group, and ``batches`` continues with the next untrained batch. Without
``guard()`` a failed collective ends the worker and the agent restarts it from the
checkpoint (the restart path).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elasticd.checkpoint.manager import CheckpointManager
from elasticd.data.sampler import ElasticSampler
from elasticd.data.stream import ElasticStream
from elasticd.errors import ConfigError
from elasticd.worker.context import (
    current_context,
    fast_exit,
    group_generation,
    ran_ahead,
    report_progress,
    should_stop,
)
from elasticd.worker.fence import agent_fence
from elasticd.worker.live import LiveState, Reformed
from elasticd.worker.peer_replica import DEFAULT_EVERY_STEPS as DEFAULT_PEER_REPLICA_EVERY
from elasticd.worker.sharded import ShardedModel

log = structlog.get_logger(__name__)

_RESERVED = ("sampler", "elastic_loop")
B = TypeVar("B")  # a loader's batch


def _sharded(state: Mapping[str, Any]) -> bool:
    """Does ``state`` hold a model with DTensor (FSDP2 / HSDP) parameters?"""
    from elasticd.checkpoint.shards import is_dtensor

    return any(isinstance(v, torch.nn.Module) and any(is_dtensor(p) for p in v.parameters())
               for v in state.values())


def batch_len(batch: object) -> int:
    """Samples in one collated batch: the first dimension of its first tensor.

    Raises:
        ConfigError: No tensor or sized value to measure (call ``loop.step_done(n)`` instead).
    """
    value: object = batch
    while True:
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() else 1
        if isinstance(value, Mapping) and value:
            value = next(iter(value.values()))
        elif isinstance(value, (list, tuple)) and value:
            if not isinstance(value[0], (torch.Tensor, Mapping, list, tuple)):
                return len(value)
            value = value[0]
        else:
            raise ConfigError(
                f"cannot tell how many samples a batch of type {type(batch).__name__} holds; "
                "iterate the loader yourself and call loop.step_done(samples_per_rank) after "
                "each optimizer step")


class ElasticLoop:
    """Checkpointed, drainable, exactly-once training over an elastic sampler.

    Args:
        state: What to checkpoint besides the sampler, e.g. ``{"model": model,
            "optimizer": optimizer}`` (the module itself, not the DDP wrapper).
        sampler: An :class:`~elasticd.data.distributed.ElasticDistributedSampler`; or an
            :class:`~elasticd.data.sampler.ElasticSampler` or
            :class:`~elasticd.data.stream.ElasticStream` when one loader batch is one
            optimizer step.
        checkpoint_url: fsspec URL; default ``$ELASTICD_CHECKPOINT_URL`` (set by the agent),
            else ``file://./checkpoints``.
        save_every: Save a checkpoint (asynchronously) every this many steps; a drain and
            the end of every epoch always save.
        keep_last: Checkpoints kept.
        manager: Use this :class:`CheckpointManager` instead of building one.
        live: Re-form in place on a membership change when the agent allows it (see the
            module doc); needs ``loop.ddp(model)`` and ``loop.guard()``, and a sampler with
            ``regroup()`` (both elasticd samplers). Off: every change restarts the workers.
            A sharded model (FSDP2 / HSDP) re-forms in place only when passed as
            ``sharded=``; a model with DTensor parameters passed without it takes the
            restart path (the new workers shard it on the new mesh and ``resume()``
            reshards the checkpoint).
        sharded: The job's :class:`~elasticd.worker.sharded.ShardedModel` (built from
            the unsharded module, the script's ``parallelize`` and ``"fsdp"`` or
            ``"hsdp"``); ``state`` holds its ``.module``. After every live re-formation
            elasticd re-applies ``parallelize`` on the new mesh and rebuilds the
            optimizers in ``state`` around their kept state: read the model as
            :attr:`model` inside the loop. An HSDP mesh re-forms in place (joiners get
            their shards from a live replica); an FSDP mesh (shard size changes) and a
            restart reshard the checkpoint. No ``loop.ddp()``: FSDP2 does the gradient sync.
            An FSDP mesh over several nodes reshards in memory instead: a join from the
            live shards, a loss from the peer-RAM replicas (below).
        peer_replica_every: With ``sharded=`` an ``"fsdp"`` mesh and ``live``: every rank
            keeps a host-memory copy of one peer's shards (a rank on another node),
            refreshed every this many steps and at each epoch's end; a node loss then
            rolls back at most this many steps instead of reading the checkpoint. 0: off.

    Raises:
        ConfigError: ``state`` uses a reserved key, ``save_every < 1``, or ``sharded``'s
            module is not in ``state``.
    """

    def __init__(self, state: Mapping[str, Any], sampler: Any, *, checkpoint_url: str | None = None,
                 save_every: int = 50, keep_last: int = 3,
                 manager: CheckpointManager | None = None, live: bool = False,
                 sharded: ShardedModel | None = None,
                 peer_replica_every: int = DEFAULT_PEER_REPLICA_EVERY) -> None:
        clash = [k for k in _RESERVED if k in state]
        if clash:
            raise ConfigError(f"ElasticLoop state uses reserved key(s) {clash}; rename them")
        if save_every < 1:
            raise ConfigError(f"save_every must be >= 1, got {save_every}")
        if sharded is not None and not any(v is sharded.module for v in state.values()):
            raise ConfigError("ElasticLoop(sharded=...): the state must hold sharded.module "
                              '(e.g. {"model": sharded.module, "optimizer": optimizer})')
        self.sharded = sharded
        ctx = current_context()  # a hot spare's worker running ahead waits for its round here
        self.ctx = ctx
        self.sampler = sampler
        if ran_ahead() and hasattr(sampler, "regroup"):
            sampler.regroup()  # built before the round, for a world of one
        # These count global batches (one step() per optimizer step), not samples per rank.
        self._per_global_batch = isinstance(sampler, (ElasticSampler, ElasticStream))
        self.save_every = save_every
        self.steps_done = 0
        self._saved_at = 0
        # The loss of the step in progress, if the loop sets it (``loop.loss = loss.item()``):
        # reported with the step, for `elasticd status --plot` and ``--watch``.
        self.loss: float | None = None
        self._live: Any = None  # the loader iterator batches() is walking
        # Travels with the state (checkpoint or live transfer): every rank must agree on
        # which steps save (a collective), joiners included.
        self._progress: dict[str, int] = {"steps_done": 0, "saved_at": 0, "samples_done": 0}
        self._state = {**state, "sampler": sampler, "elastic_loop": self._progress}
        url = checkpoint_url or ctx.checkpoint_url or "file://" + os.path.abspath("checkpoints")
        self.manager = manager or CheckpointManager(url, job=ctx.job or "local",
                                                    keep_last=keep_last, fence=agent_fence())
        self._keeper: LiveState | None = None
        if live and sharded is None and _sharded(state):
            # Survivors of an FSDP2/HSDP job hold only their shards, and without its
            # parallelize function elasticd cannot re-shard the model on a new mesh: such
            # jobs take the restart path, whose checkpoint load reshards to the new mesh.
            log.info("loop_live_reform_off", reason="sharded (DTensor) state without "
                     "sharded=ShardedModel(...): re-formations restart the workers and "
                     "reshard the checkpoint")
            live = False
        if live:
            if not hasattr(sampler, "regroup"):
                raise ConfigError(f"ElasticLoop(live=True) needs a sampler that can reshard in "
                                  f"place (regroup()); {type(sampler).__name__} cannot: use "
                                  "ElasticDistributedSampler or ElasticSampler, or live=False")
            keeper = LiveState(self._state, checkpoint=self.manager, sharded=sharded,
                               peer_replica_every=peer_replica_every)
            self._keeper = keeper if keeper.enabled else None
        self._ddp_made = False
        self._reformed = False  # guard() swallowed a failed step: batches() restarts on the new group
        self.reforms = 0

    @property
    def model(self) -> torch.nn.Module | None:
        """The sharded model as of now (a new module after each live re-formation); None
        without ``sharded=``."""
        return self.sharded.module if self.sharded is not None else None

    def resume(self) -> int:
        """Load the newest valid checkpoint, if any; a collective.

        Returns:
            The epoch to start from: the interrupted one (the sampler continues at its
            first untrained sample), the next one if it had finished, 0 on a fresh start.
        """
        if self._keeper is not None:
            # From a peer that holds the state (a node joining a running job), else from
            # the checkpoint on every rank.
            if self._keeper.resume(self._load) < 0:
                return 0
            self._adopt_progress()
        else:
            if self.manager.load_latest(self._state) is None:
                return 0
            self.steps_done = self._saved_at = int(self._progress["steps_done"])
        if self._epoch_done():
            # Saved right after an epoch's last step (a drain there): start the next one now,
            # so code that peeks at the loader before set_epoch() still finds batches.
            self.sampler.set_epoch(int(self.sampler.epoch) + 1)
        return int(self.sampler.epoch)

    def _load(self) -> int:
        """Load the newest checkpoint into the state; the last completed step, -1 if none."""
        if self.manager.load_latest(self._state) is None:
            return -1
        self._progress["saved_at"] = int(self._progress["steps_done"])  # it was saved there
        return int(self._progress["steps_done"]) - 1

    def _adopt_progress(self) -> None:
        self.steps_done = int(self._progress["steps_done"])
        self._saved_at = int(self._progress.get("saved_at", self.steps_done))

    def ddp(self, module: torch.nn.Module, **kwargs: Any) -> RegroupingDDP:
        """``DistributedDataParallel(module, **kwargs)``, rebuilt on the new group after each
        live re-formation (without a process group: ``module`` itself).

        Use it where the script built ``DDP(module, ...)``; ``.module`` is ``module``.
        """
        self._ddp_made = True
        keeper = self._keeper
        # DDP's init broadcast (rank 0's parameters) is a collective: every rank of a group
        # must agree on running it. After a start each rank loaded its own state (a fresh
        # model may differ per rank): sync. After a state agreed in memory (a joiner that
        # received it, a re-formation) every rank holds the same state and the survivors
        # rebuild without it: skip it on every rank.
        return RegroupingDDP(module, kwargs, lambda: keeper is None or not keeper.agreed_in_memory)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Wrap one training step inside :meth:`batches`: a failed collective (a peer died)
        re-forms the group in place; the step is abandoned (never applied or counted) and
        ``batches`` goes on with the next untrained batch on the new group."""
        if self._keeper is None:
            yield
            return
        try:
            with self._keeper.guard():
                yield
        except Reformed:
            if self._live is None:
                raise  # not inside batches(): the caller restarts its own iteration
            self._reformed = True

    def batches(self, loader: Iterable[B]) -> Iterator[B]:
        """Yield ``loader``'s batches; each one counts as trained once the body is done.

        After each batch: the sampler advances, progress is reported, a drain saves and
        exits 0 (all ranks at the same step), and every ``save_every`` steps a checkpoint
        is started. At the end of the loader (the epoch) the sampler moves to the next
        epoch and a checkpoint is committed.
        A ``break`` out of the loop leaves the current batch uncounted.
        """
        if self._keeper is not None and not self._ddp_made and self.sharded is None:
            raise ConfigError("ElasticLoop(live=True): build the DDP wrapper with "
                              "model = loop.ddp(model, ...) instead of DDP(model, ...), so it "
                              "can be rebuilt on the re-formed group; or pass live=False")
        while True:
            it = iter(loader)
            self._live = it
            try:
                for batch in it:
                    yield batch
                    if not self._reformed:
                        # step_done's stop agreement is a collective too: a peer that died
                        # after this rank's update makes it fail, and the group re-forms.
                        with self.guard():
                            self.step_done(None if self._per_global_batch else batch_len(batch))
                    if self._reformed:
                        break  # the group re-formed: start over from the first untrained batch
                else:
                    break  # the loader ran out
            except Reformed:  # from step_done: a drain or join elsewhere re-formed the group
                self._reformed = True
            finally:
                self._live = None
            self._after_reform(it)
        # The loader ran out: the epoch is over for this loop, even if the sampler kept a
        # tail that DataLoader(drop_last=True) dropped. Saved as "next epoch, position 0",
        # a resume starts the next epoch, and code that peeks at the loader before
        # set_epoch() still finds batches.
        self.sampler.set_epoch(int(self.sampler.epoch) + 1)
        if self._keeper is not None:
            self._keeper.refresh_replica()  # a rollback to the replica stays in this epoch
        if self.steps_done > self._saved_at:
            self.save(blocking=True)

    def _after_reform(self, old: Iterator[object]) -> None:
        """Continue on the re-formed group: the newest state is in place; reshard."""
        self._reformed = False
        self.reforms += 1
        shutdown_workers = getattr(old, "_shutdown_workers", None)
        if shutdown_workers is not None:
            shutdown_workers()  # the old loader's workers prefetched the old world's shares
        self._adopt_progress()
        self.sampler.regroup()
        self.ctx = current_context()
        log.info("loop_reformed", steps_done=self.steps_done, world_size=self.ctx.world_size,
                 rank=self.ctx.rank, epoch=int(self.sampler.epoch))

    def _epoch_done(self) -> bool:
        if hasattr(self.sampler, "epoch_done"):
            return bool(self.sampler.epoch_done)
        return int(self.sampler.steps_remaining) == 0

    def step_done(self, samples_per_rank: int | None = None, *, loss: float | None = None) -> None:
        """Record one optimizer step; for loops that do not iterate :meth:`batches`.

        Args:
            samples_per_rank: Samples this rank trained in the step (ignored for an
                ``ElasticSampler`` or ``ElasticStream``, whose step is one global batch).
            loss: The step's loss (default: ``self.loss``), for the job's history.
        """
        before = int(self.sampler.samples_trained)
        if self._per_global_batch:
            self.sampler.step()
        else:
            if samples_per_rank is None:
                raise ConfigError("step_done() needs samples_per_rank for this sampler")
            self.sampler.step(samples_per_rank)
        self.steps_done += 1
        self._progress["steps_done"] = self.steps_done
        # Samples of all ranks, cumulative over the job (the sampler's own count restarts
        # every epoch): the agent derives samples/s from its increase.
        self._progress["samples_done"] = (int(self._progress.get("samples_done", 0))
                                          + max(0, int(self.sampler.samples_trained) - before))
        report_progress(self.steps_done - 1, epoch=int(self.sampler.epoch),
                        samples=self._progress["samples_done"],
                        loss=self.loss if loss is None else loss)
        # With live re-formation a drain or join elsewhere re-forms the group here and
        # raises Reformed (batches() continues on the new group); a drain of every node
        # stops as below.
        stop = (self._keeper.step_done(self.steps_done - 1) if self._keeper is not None
                else should_stop(self.steps_done - 1))
        if stop:
            self.save(blocking=True)
            log.info("loop_drained", steps_done=self.steps_done, epoch=int(self.sampler.epoch))
            self.manager.close()
            # fast_exit skips finalisers: stop the DataLoader's worker processes now rather
            # than leave them to notice (seconds later) that their parent is gone.
            shutdown_workers = getattr(self._live, "_shutdown_workers", None)
            if shutdown_workers is not None:
                shutdown_workers()
            fast_exit(0)
        if self.steps_done % self.save_every == 0:
            self.save()

    def save(self, *, blocking: bool = False) -> None:
        """Checkpoint the state as of the last finished step (a collective).

        The checkpoint's step is that step's index, ``steps_done - 1``: ``step-N`` holds
        steps 0..N, as for every other elasticd checkpoint (``report_progress``, the
        agent's fence and ``elasticd status`` count steps the same way).
        """
        if self.steps_done == self._saved_at:
            return  # this step is saved already; a second save would be refused as not newer
        self._progress["saved_at"] = self.steps_done
        self.manager.save(self.steps_done - 1, self._state, blocking=blocking)
        self._saved_at = self.steps_done

    def close(self) -> None:
        """Wait for the last checkpoint and release the manager."""
        self.manager.close()


class RegroupingDDP:
    """A DDP wrapper that is rebuilt when the default process group changes."""

    def __init__(self, module: torch.nn.Module, kwargs: dict[str, Any],
                 init_sync: Callable[[], bool]) -> None:
        self.module = module
        self._kwargs = kwargs
        self._init_sync = init_sync
        self._group: Any = None
        self._ddp: Any = None

    def _current(self) -> torch.nn.Module:
        if not dist.is_initialized():
            return self.module
        group = (dist.group.WORLD, group_generation())  # a reconfigured group is the same object
        if self._ddp is None or group != self._group:
            self._ddp = DDP(self.module, **{"init_sync": self._init_sync(), **self._kwargs})
            self._group = group
        return self._ddp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._current()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._current(), name)
