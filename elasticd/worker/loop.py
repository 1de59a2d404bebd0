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
generator is resumed), that batch counts as trained. Prefetched batches never count. Over
an ``ElasticSampler`` a loader batch counts as one global batch, so it must be the rank's
whole share (checked per batch, and the forms that cannot stay so across a re-formation
are refused up front); over an ``ElasticDistributedSampler`` the partial last batch a
``DataLoader(drop_last=True)`` drops is trained, not lost. ``loop.close()`` saves the last
step (docs/worker-api.md, "Input pipelines", has the table of pipelines and the rules).

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
import enum
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import structlog
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler

from elasticd.checkpoint.cadence import AUTO
from elasticd.checkpoint.manager import CheckpointManager
from elasticd.control.environment import agent_environment
from elasticd.data.batch_sampler import ElasticBatchSampler
from elasticd.data.distributed import ElasticDistributedSampler
from elasticd.data.positions import PositionedBatchSampler
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
from elasticd.worker.failures import stale_group_error
from elasticd.worker.fence import agent_fence
from elasticd.worker.fingerprint import ReplicaFingerprints, ddp_replicas, hsdp_replicas
from elasticd.worker.live import LiveState, Reformed
from elasticd.worker.loop_saves import LoopSaves
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


def loader_batch_sampler(loader: object) -> object | None:
    """The batch sampler a loader cuts its batches with, through elasticd's wrappers
    (``ElasticStatefulLoader``, ``PositionedBatchSampler``); None if it has none."""
    inner = getattr(loader, "loader", loader)  # ElasticStatefulLoader wraps the loader
    found = getattr(inner, "batch_sampler", None)
    return found.batch_sampler if isinstance(found, PositionedBatchSampler) else found


ONE_STEP_PLAN = ("plan_global_batch(global_batch, world_size, max_micro_batch=global_batch, "
                 "allow_uneven=True) in DataLoader(dataset, batch_sampler=ElasticBatchSampler("
                 "sampler, plan)), reading the loss scale from loader.batch_sampler.plan")


def check_global_batch_pipeline(sampler: ElasticSampler, loader: object, *, live: bool) -> None:
    """Refuse a loader that ``ElasticLoop.batches`` cannot count right over ``sampler``.

    ``batches`` counts one loader batch as one optimizer step (one global batch), so each
    loader batch must be this rank's whole share of a global batch, at every world size
    the job re-forms to (live) or starts at (restart path).

    Raises:
        ConfigError: An ``ElasticBatchSampler`` of another sampler, or whose plan needs
            gradient accumulation (now, or under ``live`` at some smaller world, or an
            even plan that a world size may not split); under ``live`` a plain
            ``DataLoader(batch_size=...)``, whose per-rank batch is fixed at the world
            size it was built for. Each message names the supported form.
    """
    found = loader_batch_sampler(loader)
    if isinstance(found, ElasticBatchSampler):
        if found.sampler is not sampler:
            raise ConfigError("ElasticLoop: the loader's ElasticBatchSampler wraps another "
                              "sampler than the loop's; pass the same ElasticSampler to both")
        plan = found.plan
        if plan.accumulation_steps != 1:
            raise ConfigError(
                f"ElasticLoop.batches counts one loader batch as one optimizer step, but the "
                f"batch plan runs {plan.accumulation_steps} micro-steps per step ({plan.reason}); "
                f"use {ONE_STEP_PLAN}, or run your own accumulation loop and call "
                "loop.step_done() after each optimizer step")
        bound = plan.max_micro_batch or plan.micro_batch_size
        if live and (bound < plan.global_batch_size or not plan.allow_uneven):
            raise ConfigError(
                f"ElasticLoop(live=True): the batch plan ({plan.reason}, max_micro_batch "
                f"{bound}, allow_uneven={plan.allow_uneven}) cannot be re-planned as one "
                "micro-batch per step at every world size a re-formation may leave (down to "
                f"one rank taking all {plan.global_batch_size} samples); use {ONE_STEP_PLAN}")
    elif live and isinstance(found, BatchSampler):
        raise ConfigError(
            "ElasticLoop(live=True) over an ElasticSampler: DataLoader(batch_size=...) keeps the "
            "per-rank batch of the world size it was built for, and after a re-formation each "
            "loader batch would be part of a share while the sampler counts the whole global "
            f"batch; use {ONE_STEP_PLAN}")


def check_share(sampler: ElasticSampler, batch: object) -> None:
    """Refuse to count a loader batch that is not this rank's whole share of a global batch.

    Raises:
        ConfigError: the batch holds another number of samples than ``sampler.share_size``
            (a batch size or plan made for another world size).
    """
    try:
        size = batch_len(batch)
    except ConfigError:
        return  # not measurable: the loader is trusted (step_done documents the contract)
    if size != sampler.share_size:
        raise ConfigError(
            f"ElasticLoop.batches got a batch of {size} samples, but rank {sampler.rank}'s share "
            f"of a global batch of {sampler.global_batch_size} at world size "
            f"{sampler.num_replicas} is {sampler.share_size}: counting it as a trained global "
            f"batch would skip samples; use {ONE_STEP_PLAN}")


def dropped_tail(sampler: object, loader: object) -> list[Any]:
    """The samples (indices or keys) of this rank that a loader which ran out dropped.

    Only an :class:`ElasticDistributedSampler` in a ``DataLoader(drop_last=True)`` leaves
    any: its epoch is not done although the loader ended (fewer than ``batch_size``
    samples per rank remain; the count is the same on every rank, so every rank trains
    one more, smaller, batch). Empty otherwise.
    """
    if (not isinstance(sampler, ElasticDistributedSampler)
            or not getattr(loader, "drop_last", False) or sampler.epoch_done):
        return []
    return list(sampler)


def _scheduled(optimizer: torch.optim.Optimizer) -> bool:
    """Has an LR scheduler been attached to ``optimizer``? torch's LRScheduler wraps the
    optimizer's ``step`` and marks the wrapper (tests/unit/test_elastic_loop.py pins it)."""
    return bool(getattr(optimizer.step, "_wrapped_by_lr_sched", False))


def check_state(state: Mapping[str, Any]) -> str | None:
    """What the loop's state leaves out that a resume would silently reset.

    Returns:
        A warning when the state holds no optimizer (its moments and step counts restart
        from zero on every resume, unless it keeps none, as plain SGD); else None.

    Raises:
        ConfigError: An LR scheduler is attached to an optimizer of the state but is not
            in the state itself: every resume would restart the schedule (warm-up and
            all); the message names the fix.
    """
    from torch.optim.lr_scheduler import LRScheduler

    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    saved = {id(v.optimizer) for v in state.values() if isinstance(v, LRScheduler)}
    for name, opt in state.items():
        if isinstance(opt, torch.optim.Optimizer) and _scheduled(opt) and id(opt) not in saved:
            raise ConfigError(
                f"an LR scheduler is attached to the optimizer {name!r} but is not in the "
                "ElasticLoop state: every resume would restart its schedule; add it, e.g. "
                f'ElasticLoop({{..., "{name}": optimizer, "scheduler": scheduler}}, sampler)')
    if not optimizers:
        return ("the ElasticLoop state holds no torch.optim.Optimizer: a resume restarts the "
                "optimizer's state (momentum, Adam moments, step counts) from zero; add it, e.g. "
                '{"model": model, "optimizer": optimizer}')
    return None


def check_loop_args(state: Mapping[str, Any], save_every: int | str, sharded: ShardedModel | None) -> None:
    """Refuse what :class:`ElasticLoop` cannot work with.

    Raises:
        ConfigError: a reserved state key, ``save_every`` neither ``"auto"`` nor >= 1, or
            ``sharded``'s module not in ``state``.
    """
    clash = [k for k in _RESERVED if k in state]
    if clash:
        raise ConfigError(f"ElasticLoop state uses reserved key(s) {clash}; rename them")
    if save_every != AUTO and (not isinstance(save_every, int) or save_every < 1):
        raise ConfigError(f'save_every must be "auto" or a number of steps >= 1, got {save_every!r}')
    if sharded is not None and not any(v is sharded.module for v in state.values()):
        raise ConfigError("ElasticLoop(sharded=...): the state must hold sharded.module "
                          '(e.g. {"model": sharded.module, "optimizer": optimizer})')


def epoch_done(sampler: Any) -> bool:
    """Has the sampler's epoch no untrained step left?"""
    if hasattr(sampler, "epoch_done"):
        return bool(sampler.epoch_done)
    return int(sampler.steps_remaining) == 0


def live_keeper(state: dict[str, Any], sampler: Any, manager: CheckpointManager,
                sharded: ShardedModel | None, peer_replica_every: int) -> LiveState | None:
    """The loop's :class:`LiveState` when live re-formation can work (None: the restart path).

    Raises:
        ConfigError: the sampler cannot reshard in place (no ``regroup()``).
    """
    if sharded is None and _sharded(state):
        # Survivors of an FSDP2/HSDP job hold only their shards, and without its
        # parallelize function elasticd cannot re-shard the model on a new mesh: such
        # jobs take the restart path, whose checkpoint load reshards to the new mesh.
        log.info("loop_live_reform_off", reason="sharded (DTensor) state without "
                 "sharded=ShardedModel(...): re-formations restart the workers and "
                 "reshard the checkpoint")
        return None
    if not hasattr(sampler, "regroup"):
        raise ConfigError(f"ElasticLoop(live=True) needs a sampler that can reshard in "
                          f"place (regroup()); {type(sampler).__name__} cannot: use "
                          "ElasticDistributedSampler or ElasticSampler, or live=False")
    keeper = LiveState(state, checkpoint=manager, sharded=sharded, peer_replica_every=peer_replica_every)
    return keeper if keeper.enabled else None


def with_tail(it: Iterator[B], loader: Iterable[B], sampler: Any) -> Iterator[B]:
    """``it``'s batches, then the partial last batch a ``DataLoader(drop_last=True)``
    dropped: after a resize mid-epoch the remaining samples are dealt over the new
    ranks and a rank's share rarely fills its last batch; dropping it would leave
    those samples untrained this epoch (a fault-free run trains them)."""
    yield from it
    tail = dropped_tail(sampler, loader)
    if tail:
        log.info("loop_tail_trained", samples_per_rank=len(tail), epoch=int(sampler.epoch))
        dataset, collate = loader.dataset, loader.collate_fn  # type: ignore[attr-defined]
        yield collate([dataset[i] for i in tail])


def shutdown_loader(it: object) -> None:
    """Stop a DataLoader iterator's worker processes now (a no-op for other iterators)."""
    shutdown_workers = getattr(it, "_shutdown_workers", None)
    if shutdown_workers is not None:
        shutdown_workers()


def replica_fingerprints(state: dict[str, Any], progress: dict[str, int], every: int | None,
                         keeper: Any, *, sharded: ShardedModel | None) -> ReplicaFingerprints | None:
    """The loop's replica fingerprints; a rank they name diverged offers no state to a live
    re-formation (``keeper.suspect``). None with ``every`` 0, for an FSDP mesh (no
    replicas) and for DTensor state not passed as ``sharded=`` (its mesh is unknown)."""
    if every == 0 or (sharded is None and _sharded(state)):
        return None
    if sharded is not None and sharded.mesh_kind != "hsdp":
        return None
    replicas = ddp_replicas if sharded is None else hsdp_replicas(sharded)
    fingerprints = ReplicaFingerprints(state, progress, every=every, replicas=replicas)
    if keeper is not None:
        keeper.suspect = lambda: fingerprints.suspect
    return fingerprints


class EpochAction(enum.Enum):
    """What ``batches()`` does after a re-formation, by the epoch the adopted state is in."""

    CONTINUE = "continue"  # same epoch: go on from the first untrained batch
    END = "end"  # a later epoch: this call's epoch is over for the whole group


def reform_epoch_action(iterating: int, adopted: int) -> EpochAction:
    """Whether ``batches()``, iterating epoch ``iterating``, goes on after a re-formation
    left the sampler in epoch ``adopted``.

    A rank that was frozen or behind adopts the newest rank's state, possibly epochs later;
    going on would train that epoch under the caller's older epoch (whose loop variable,
    checkpoint and end-of-epoch save are the old epoch's), then rewind at its next
    ``set_epoch()``. An earlier adopted epoch (a rollback to a replica) goes on.
    """
    return EpochAction.END if adopted > iterating else EpochAction.CONTINUE


# How to fix a step that used a handle from before a live re-formation (exit 78).
STALE_HANDLE_FIX = ("after a re-formation use loop.model (sharded=) or the module loop.ddp() "
                    "returned, never a DDP/FSDP handle or process group kept from before")


def check_live_ddp(live_ddp: bool, ddp_made: bool) -> None:
    """Refuse a live replicated loop whose DDP wrapper the loop did not build.

    Raises:
        ConfigError: ``live_ddp`` and no ``loop.ddp(...)`` call yet.
    """
    if live_ddp and not ddp_made:
        raise ConfigError("ElasticLoop(live=True): build the DDP wrapper with "
                          "model = loop.ddp(model, ...) instead of DDP(model, ...), so it "
                          "can be rebuilt on the re-formed group; or pass live=False")


class EpochCatchUp:
    """A rank that adopted a later epoch in a live re-formation (it was frozen or behind)
    catches up with the caller's epoch loop: the group finished the epoch being iterated
    while this rank was away, so that epoch's loop ends (:meth:`ended`), and each skipped
    epoch's ``set_epoch(e)``, which reset the sampler, is undone (:meth:`skip`)."""

    def __init__(self) -> None:
        self.adopted: tuple[int, dict[str, Any]] | None = None  # (epoch, sampler state)

    def ended(self, epoch: int, sampler: Any) -> bool:
        """After a re-formation: is ``epoch``'s loop over because the adopted state is later?"""
        if reform_epoch_action(epoch, int(sampler.epoch)) is not EpochAction.END:
            return False
        self.adopted = (int(sampler.epoch), sampler.state_dict())
        log.info("loop_epoch_ended_by_group", epoch=epoch, adopted_epoch=int(sampler.epoch),
                 samples_trained=int(sampler.samples_trained))
        return True

    def skip(self, sampler: Any) -> bool:
        """Was this epoch trained by the group before this rank rejoined? Then the adopted
        position is restored and the epoch yields nothing."""
        if self.adopted is None:
            return False
        adopted_epoch, adopted = self.adopted
        if int(sampler.epoch) >= adopted_epoch:
            self.adopted = None  # caught up: set_epoch(adopted) kept the position
            return False
        log.info("loop_epoch_skipped", epoch=int(sampler.epoch), adopted_epoch=adopted_epoch,
                 reason="trained by the group while this rank was away")
        sampler.load_state_dict(adopted)
        return True


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
            the end of every epoch always save. ``"auto"``: the interval that minimises
            expected lost work from the measured save cost and the job's loss rate, <= 1 %
            overhead (:mod:`elasticd.worker.save_cadence`; 50 steps until a save is
            measured). The agent's ``[checkpoint] every`` overrides it (with ``"auto"``
            this number is the steps until a save is measured).
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
        fingerprint_every: Compare the ranks' model and optimizer fingerprints every this
            many steps and restore a diverged rank from the majority
            (:mod:`elasticd.worker.fingerprint`); None: measured, <= 0.5 % of step time;
            0: off. With ``sharded=`` an HSDP mesh: the replicas of each shard compare
            their local shards; an FSDP mesh has no replicas (off).

    Raises:
        ConfigError: ``state`` uses a reserved key, ``save_every`` neither ``"auto"`` nor
            >= 1, or ``sharded``'s module is not in ``state``.
    """

    def __init__(self, state: Mapping[str, Any], sampler: Any, *, checkpoint_url: str | None = None,
                 save_every: int | str = 50, keep_last: int = 3,
                 manager: CheckpointManager | None = None, live: bool = False,
                 sharded: ShardedModel | None = None,
                 peer_replica_every: int = DEFAULT_PEER_REPLICA_EVERY,
                 fingerprint_every: int | None = None) -> None:
        check_loop_args(state, save_every, sharded)
        self.sharded = sharded
        ctx = current_context()  # a hot spare's worker running ahead waits for its round here
        self.ctx = ctx
        self.sampler = sampler
        if ran_ahead() and hasattr(sampler, "regroup"):
            sampler.regroup()  # built before the round, for a world of one
        # These count global batches (one step() per optimizer step), not samples per rank.
        self._per_global_batch = isinstance(sampler, (ElasticSampler, ElasticStream))
        self.steps_done = 0
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
        self._saves = LoopSaves(self._state, self._progress, self.manager, save_every, agent_environment())
        self.save_every, self.cadence = self._saves.save_every, self._saves.cadence
        self._keeper = (live_keeper(self._state, sampler, self.manager, sharded, peer_replica_every)
                        if live else None)
        self.fingerprints = replica_fingerprints(self._state, self._progress, fingerprint_every,
                                                 self._keeper, sharded=sharded)
        self._state_checked = False
        self._ddp_made = False
        self._reformed = False  # guard() swallowed a failed step: batches() restarts on the new group
        self._catch_up = EpochCatchUp()  # a rank moved to a later epoch by a re-formation
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

        Raises:
            ConfigError: an LR scheduler of a state optimizer is missing from the state.
        """
        self._check_state()
        if self._keeper is not None:
            # From a peer that holds the state (a node joining a running job), else from
            # the checkpoint on every rank.
            if self._keeper.resume(self._saves.load) < 0:
                return 0
            self._adopt_progress()
        else:
            loaded = self._saves.load_latest()
            if loaded is None:
                return 0
            self.steps_done = loaded
        if epoch_done(self.sampler):
            # Saved right after an epoch's last step (a drain there): start the next one now,
            # so code that peeks at the loader before set_epoch() still finds batches.
            self.sampler.set_epoch(int(self.sampler.epoch) + 1)
        return int(self.sampler.epoch)

    def _check_state(self) -> None:
        """Once, at resume or the first batches(): what a resume would silently reset."""
        if self._state_checked:
            return
        self._state_checked = True
        warning = check_state(self._state)
        if warning is not None:
            log.warning("loop_state_incomplete", reason=warning)

    def _adopt_progress(self) -> None:
        self.steps_done = int(self._progress["steps_done"])
        self._saves.adopt(self.steps_done)

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
        except (ValueError, RuntimeError) as exc:
            if self.reforms and stale_group_error(exc):
                raise ConfigError(f"the step used a module or group from before the live "
                                  f"re-formation ({exc}); {STALE_HANDLE_FIX}") from exc
            raise
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
        check_live_ddp(self._keeper is not None and self.sharded is None, self._ddp_made)
        self._check_state()
        global_batches = isinstance(self.sampler, ElasticSampler)
        if global_batches:
            check_global_batch_pipeline(self.sampler, loader, live=self._keeper is not None)
        if self._catch_up.skip(self.sampler):
            return
        epoch = int(self.sampler.epoch)
        while True:
            it = iter(loader)
            self._live = it
            try:
                for batch in with_tail(it, loader, self.sampler):
                    if global_batches:
                        check_share(self.sampler, batch)
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
            if self._catch_up.ended(epoch, self.sampler):
                return  # without the end-of-epoch save: the others are mid-epoch
        # The loader (and its tail, above) ran out: the epoch is over for this loop. Saved as
        # "next epoch, position 0", a resume starts the next epoch, and code that peeks at
        # the loader before set_epoch() still finds batches.
        self.sampler.set_epoch(int(self.sampler.epoch) + 1)
        if self._keeper is not None:
            self._keeper.refresh_replica()  # a rollback to the replica stays in this epoch
        if self.steps_done > self._saves.saved_at:
            self.save(blocking=True)

    def _after_reform(self, old: Iterator[object]) -> None:
        """Continue on the re-formed group: the newest state is in place; reshard."""
        self._reformed = False
        self.reforms += 1
        shutdown_loader(old)  # the old loader's workers prefetched the old world's shares
        self._adopt_progress()
        self.sampler.regroup()
        self.ctx = current_context()
        log.info("loop_reformed", steps_done=self.steps_done, world_size=self.ctx.world_size,
                 rank=self.ctx.rank, epoch=int(self.sampler.epoch))

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
        if self.fingerprints is not None:  # before any save: a diverged state is never kept
            self.fingerprints.step_done(self.steps_done)
        if self.cadence is not None:
            self.cadence.step_done()
        report_progress(self.steps_done - 1, epoch=int(self.sampler.epoch),
                        samples=self._progress["samples_done"],
                        loss=self.loss if loss is None else loss,
                        cadence=self.cadence.chosen if self.cadence is not None else None)
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
            shutdown_loader(self._live)
            fast_exit(0)
        if self._saves.due(self.steps_done):
            self.save()

    def save(self, *, blocking: bool = False) -> None:
        """Checkpoint the state as of the last finished step (a collective).

        The checkpoint's step is that step's index, ``steps_done - 1``: ``step-N`` holds
        steps 0..N, as for every other elasticd checkpoint (``report_progress``, the
        agent's fence and ``elasticd status`` count steps the same way).
        """
        self._saves.save(self.steps_done, blocking=blocking)

    def close(self) -> None:
        """Save the last finished step if it is not saved yet, wait for the checkpoint to
        commit and release the manager; a collective (call it on every rank).

        A job that ends at a step limit (a ``break`` out of :meth:`batches`) or anywhere
        between ``save_every`` steps would otherwise leave its last steps unsaved: a re-run
        would retrain them, or, if the agent records the job as finished, never train them.
        """
        if self.steps_done > self._saves.saved_at:
            self.save(blocking=True)
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
