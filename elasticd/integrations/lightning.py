"""Lightning under elasticd: exactly-once data order, a constant global batch, drain and resume.

A Lightning ``Trainer`` owns the training loop, so elasticd's guarantees come in through
Lightning's own extension points (docs/integrations/lightning.md has the diff of a plain
script, four lines)::

    elastic = ElasticCallback(global_batch_size=64, max_micro_batch=32)
    loader = DataLoader(dataset, batch_sampler=elastic.batch_sampler(dataset))
    trainer = L.Trainer(..., callbacks=[elastic], plugins=[elastic.environment()],
                        use_distributed_sampler=False)
    trainer.fit(model, loader)

- :meth:`ElasticCallback.batch_sampler` reads the dataset through
  :class:`~elasticd.data.sampler.ElasticSampler` and
  :class:`~elasticd.data.batch_sampler.ElasticBatchSampler`: one global permutation per
  epoch whatever the world size, cut into micro-batches of one constant global batch.
  ``use_distributed_sampler=False`` keeps Lightning from putting its ``DistributedSampler``
  in their place.
- Once Lightning has formed the process group (the ``setup`` hook) the sampler is
  sharded for the world size of this start, and ``trainer.accumulate_grad_batches`` is set
  from the batch plan (as Lightning's ``GradientAccumulationScheduler`` sets it), so one
  optimizer step always trains the same global batch.
- At ``on_train_start`` an :class:`~elasticd.worker.loop.ElasticLoop` over the module,
  its optimizers and LR schedulers and the sampler loads elasticd's newest committed
  checkpoint (model, optimizers, schedulers, sampler position, RNG) and Lightning's epoch
  counter is set to the resumed epoch; after every optimizer step the loop counts the
  global batch, reports progress to the agent (``elasticd status``), agrees with every rank
  on a drain (a SIGTERM to the agent, a spot notice, a node joining) and then commits the
  step through the agent's fence and exits 0; every ``save_every`` steps and at each
  epoch's end it commits a checkpoint.
- :class:`ElasticEnvironment` is Lightning's torchelastic cluster environment without its
  check that ``devices * num_nodes`` equals the world size: under elasticd the number of
  nodes is whatever the last rendezvous admitted.

No live re-formation: Lightning's ``DDPStrategy`` builds the process group and the DDP
wrapper once per ``fit`` and has no hook to rebuild them on a new group, so every
membership change takes the restart path (the agent restarts the workers, which resume
from the checkpoint the drain committed, or from the last one after a kill).
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Any

import lightning.pytorch as pl
import structlog
import torch
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    TorchElasticEnvironment,
)

from elasticd.data.batch_sampler import ElasticBatchSampler
from elasticd.data.batching import plan_global_batch
from elasticd.data.sampler import ElasticSampler
from elasticd.errors import ConfigError
from elasticd.worker.context import current_context
from elasticd.worker.loop import ElasticLoop

log = structlog.get_logger(__name__)


def checkpoint_state(module: torch.nn.Module, optimizers: Sequence[object],
                     schedulers: Sequence[object]) -> dict[str, object]:
    """What elasticd checkpoints of a Lightning run besides the sampler: the module, every
    optimizer and every LR scheduler, under names that do not depend on the world size.

    One optimizer is ``"optimizer"`` and one scheduler ``"scheduler"`` (the names
    ``ElasticLoop`` checks for a forgotten scheduler); several are numbered from 0.
    """
    state: dict[str, object] = {"model": module}
    for kind, items in (("optimizer", optimizers), ("scheduler", schedulers)):
        if len(items) == 1:
            state[kind] = items[0]
        else:
            state.update({f"{kind}_{i}": item for i, item in enumerate(items)})
    return state


def check_loader(batch_sampler: object, ours: object) -> None:
    """Refuse a training loader whose batches do not come from elasticd's batch sampler.

    Args:
        batch_sampler: The batch sampler of the loader the Trainer iterates.
        ours: The callback's :class:`ElasticBatchSampler`.

    Raises:
        ConfigError: Lightning replaced it (``use_distributed_sampler=True`` on several
            ranks), or the Trainer trains another loader; the message names the fix.
    """
    if batch_sampler is not ours:
        raise ConfigError("ElasticCallback: the Trainer does not read the DataLoader of "
                          "batch_sampler=elastic.batch_sampler(dataset) as built (Lightning replaces its sampler "
                          "unless Trainer(use_distributed_sampler=False)); pass that loader to "
                          "trainer.fit() and use_distributed_sampler=False to the Trainer")


def check_accumulation(accumulate_grad_batches: object) -> None:
    """Refuse a Trainer whose own gradient accumulation would change the global batch.

    Raises:
        ConfigError: ``accumulate_grad_batches`` is not 1, naming the Trainer argument.
    """
    if accumulate_grad_batches != 1:
        raise ConfigError(f"ElasticCallback sets accumulate_grad_batches from the world size (the "
                          f"global batch is constant), but the Trainer has {accumulate_grad_batches!r}; "
                          "leave Trainer(accumulate_grad_batches=...) unset")


def check_accumulation_supported(accumulation_steps: int, automatic_optimization: bool) -> None:
    """Refuse a plan that needs gradient accumulation for a module that steps by hand.

    Lightning accumulates only under automatic optimization; a manual ``optimizer.step()``
    per micro-batch would train a smaller global batch than the job's.

    Raises:
        ConfigError: ``accumulation_steps > 1`` with manual optimization, naming the fix.
    """
    if accumulation_steps > 1 and not automatic_optimization:
        raise ConfigError(f"ElasticCallback: at this world size one global batch takes "
                          f"{accumulation_steps} micro-batches per rank, and a module with "
                          "automatic_optimization=False steps by hand; raise max_micro_batch to the "
                          "global batch size, or use automatic optimization")


class ElasticEnvironment(TorchElasticEnvironment):
    """torchelastic's cluster environment for a world whose node count changes.

    Lightning checks ``devices * num_nodes == WORLD_SIZE`` once at start; under elasticd the
    number of nodes is the rendezvous' to decide, so only ``devices`` (the processes per
    node, ``--nproc-per-node``) must divide the world size. Ranks, world size and the
    rendezvous address come from the agent's (torchrun's) environment, as for torchelastic.
    """

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Accept any node count; the world size must be a multiple of ``devices``.

        Raises:
            ValueError: the world size is not a multiple of ``num_devices`` (Lightning's
                own error type for this check).
        """
        world = self.world_size()
        if world % num_devices:
            raise ValueError(f"Trainer(devices={num_devices}) does not divide the world size "
                             f"{world}; set devices to the agent's --nproc-per-node")


class ElasticCallback(pl.Callback):
    """elasticd's sampler, constant global batch, drain, fenced checkpoints and resume for a
    Lightning ``Trainer`` (see the module doc for what each hook does).

    Args:
        global_batch_size: Samples per optimizer step over all ranks, at any world size.
        max_micro_batch: Most samples one forward/backward may take (default: the whole
            global batch); the plan accumulates gradients over as few micro-batches as fit.
            The global batch must split evenly over every world size the job runs at.
        seed: Seed of the data order; the same on every rank and across restarts.
        shuffle: Walk a seeded permutation (True) or the dataset in order.
        save_every: Commit a checkpoint every this many optimizer steps (a drain and each
            epoch's end always commit).
        checkpoint_url: fsspec URL of elasticd's checkpoints; default the agent's
            (``$ELASTICD_CHECKPOINT_URL``), else ``file://./checkpoints``.
        keep_last: Checkpoints kept.

    Raises:
        ConfigError: a size < 1 (from the batch plan), named.
    """

    def __init__(self, global_batch_size: int, max_micro_batch: int | None = None, *, seed: int = 0,
                 shuffle: bool = True, save_every: int = 50, checkpoint_url: str | None = None,
                 keep_last: int = 3) -> None:
        super().__init__()
        self.max_micro_batch = max_micro_batch or global_batch_size
        plan_global_batch(global_batch_size, 1, self.max_micro_batch)  # bad sizes fail here, at once
        self.global_batch_size = global_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.save_every, self.checkpoint_url, self.keep_last = save_every, checkpoint_url, keep_last
        self.sampler: ElasticSampler | None = None
        self._batch_sampler: ElasticBatchSampler | None = None
        self.loop: ElasticLoop | None = None
        self._global_step = 0  # trainer.global_step at the last counted optimizer step

    def environment(self) -> ClusterEnvironment:
        """The cluster environment plugin to pass as ``Trainer(plugins=[...])``:
        :class:`ElasticEnvironment` under an agent or torchrun, else Lightning's default
        (a script run by hand, where Lightning starts the processes itself)."""
        return ElasticEnvironment() if ElasticEnvironment.detect() else LightningEnvironment()

    def batch_sampler(self, dataset: Sized) -> ElasticBatchSampler:
        """The batch sampler of the training ``DataLoader``: elasticd's data order.

        Use as ``DataLoader(dataset, batch_sampler=elastic.batch_sampler(dataset), ...)``
        (no ``batch_size``, ``shuffle``, ``sampler`` or ``drop_last``: the callback's
        ``global_batch_size``, ``max_micro_batch`` and ``shuffle`` set them); one per callback.

        Raises:
            ConfigError: a second call, or a dataset too small for one global batch.
        """
        if self.sampler is not None:
            raise ConfigError("ElasticCallback.batch_sampler() was called twice; use one "
                              "ElasticCallback per training DataLoader")
        # World size 1 until Lightning has formed the group: setup() reshards it.
        self.sampler = ElasticSampler(dataset, global_batch_size=self.global_batch_size,
                                      num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed)
        plan = plan_global_batch(self.global_batch_size, 1, self.max_micro_batch)
        self._batch_sampler = ElasticBatchSampler(self.sampler, plan)
        return self._batch_sampler

    @property
    def steps_done(self) -> int:
        """Optimizer steps of the job so far (restored on resume), 0 before training starts."""
        return self.loop.steps_done if self.loop is not None else 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Shard the sampler for this start's world and set the gradient accumulation."""
        if stage != "fit":
            return
        if self.sampler is None or self._batch_sampler is None:
            raise ConfigError("ElasticCallback: build the training DataLoader with "
                              "batch_sampler=elastic.batch_sampler(dataset) so elasticd owns the data order")
        ctx = current_context()  # after Lightning's init_process_group: elasticd joins that group
        check_accumulation(trainer.accumulate_grad_batches)
        self.sampler.regroup(ctx.world_size, ctx.rank)
        plan = self._batch_sampler.plan  # re-planned for the new world
        check_accumulation_supported(plan.accumulation_steps, pl_module.automatic_optimization)
        trainer.accumulate_grad_batches = plan.accumulation_steps
        log.info("lightning_batch_planned", world_size=ctx.world_size, rank=ctx.rank,
                 accumulation_steps=plan.accumulation_steps, reason=plan.reason)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resume from elasticd's newest committed checkpoint, at its epoch and position."""
        assert self.sampler is not None  # setup() refused a run without it
        check_loader(getattr(trainer.train_dataloader, "batch_sampler", None), self._batch_sampler)
        state = checkpoint_state(pl_module, trainer.optimizers,
                                 [c.scheduler for c in trainer.lr_scheduler_configs])
        self.loop = ElasticLoop(state, self.sampler, checkpoint_url=self.checkpoint_url,
                                save_every=self.save_every, keep_last=self.keep_last)
        epoch = self.loop.resume()
        # Lightning's epoch counter drives max_epochs and the sampler's set_epoch(): it
        # must start at the resumed epoch, or set_epoch(0) would rewind the data order.
        progress = trainer.fit_loop.epoch_progress
        progress.reset()
        progress.increment_by(epoch)
        self._global_step = trainer.global_step
        log.info("lightning_resumed", epoch=epoch, steps_done=self.loop.steps_done)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """After an optimizer step: count the global batch, report it, drain if asked."""
        if trainer.global_step == self._global_step:
            return  # a micro-batch inside an accumulation: no step yet
        self._global_step = trainer.global_step
        assert self.loop is not None
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        # On a drain every rank commits this step through the agent's fence and exits 0.
        self.loop.step_done(loss=float(loss) if isinstance(loss, torch.Tensor) else None)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Commit the epoch: a resume starts the next one at its first sample."""
        assert self.loop is not None and self.sampler is not None
        self.sampler.set_epoch(int(self.sampler.epoch) + 1)
        self.loop.save(blocking=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Commit the last step and wait for the checkpoint (a collective)."""
        if self.loop is not None:
            self.loop.close()
