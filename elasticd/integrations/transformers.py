"""elasticd's guarantees for a Hugging Face ``Trainer`` script (docs/integrations/transformers.md).

The Trainer drives its own loop; elasticd enters through the Trainer's extension points
only: a subclass that overrides ``get_train_dataloader`` (the documented hook for a
custom loader) and a ``TrainerCallback`` for the rest::

    trainer = ElasticTrainer(model=model, args=args, train_dataset=dataset,
                             global_batch_size=16)
    trainer.train()

What it changes:

- **Data order.** The loader walks an :class:`~elasticd.data.sampler.ElasticSampler`
  (one global permutation per epoch, a rank's share by (rank, world size)), cut into
  micro-batches of at most ``per_device_train_batch_size`` by an
  :class:`~elasticd.data.batch_sampler.ElasticBatchSampler`. Accelerate does not re-shard
  it. The Trainer's own skip-by-count resume is never used.
- **Constant global batch.** ``gradient_accumulation_steps`` is set from
  :func:`~elasticd.data.batching.plan_global_batch` for this run's world size, so one
  optimizer step trains ``global_batch_size`` samples at any world size. The Trainer
  scales the loss by the tokens of the whole global batch (``num_items_in_batch``,
  gathered across ranks), so the gradient does not depend on how the batch was split.
- **Resume, progress, drain, checkpoints.** An :class:`~elasticd.worker.loop.ElasticLoop`
  (restart path) holds the model, the Trainer's optimizer and LR scheduler and the
  sampler. At ``on_train_begin`` it loads elasticd's newest committed checkpoint and the
  Trainer's ``global_step`` follows it; at every ``on_step_end`` it counts the step,
  reports progress to the agent, commits a checkpoint every ``save_every`` steps and at
  every epoch's end, and on a drain (SIGTERM to the agent, a spot notice) every rank
  commits the same step through the agent's fence and the worker exits 0.
- **No live re-formation.** The Trainer's DDP wrapper is built once by Accelerate inside
  ``train()`` and its loop has no seam to abandon a failed step, so a membership change
  restarts the workers and they resume from the newest checkpoint.

The Trainer's own epoch counter is not the data's: the loader yields the sampler's
current epoch from its resumed position, and the Trainer stops at its ``max_steps``,
which is the same at every world size because the global batch is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import structlog
import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from elasticd import worker
from elasticd.data.batch_sampler import ElasticBatchSampler
from elasticd.data.batching import plan_global_batch
from elasticd.data.sampler import ElasticSampler
from elasticd.data.sharding import steps_remaining
from elasticd.errors import ConfigError
from elasticd.worker.loop import ElasticLoop

log = structlog.get_logger(__name__)


class EpochLoader(DataLoader):
    """A ``DataLoader`` over an ``ElasticBatchSampler`` whose length is a whole epoch.

    The Trainer sizes its epochs (and ``max_steps``, hence the LR schedule) from
    ``len(loader)``: a full epoch of micro-batches, the same number of optimizer steps at
    every world size. Iterating yields what is left of the sampler's current epoch, and
    nothing once ``finished()`` says the job has trained all its steps.
    """

    def __init__(self, dataset: Any, batch_sampler: ElasticBatchSampler, collate_fn: Any,
                 finished: Callable[[], bool], **kwargs: Any) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, **kwargs)
        self._elastic = batch_sampler
        self._finished = finished

    def __len__(self) -> int:
        sampler = self._elastic.sampler
        steps = steps_remaining(len(self.dataset), sampler.global_batch_size, 0,  # type: ignore[arg-type]
                                sampler.drop_last)
        return steps * self._elastic.plan.accumulation_steps

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # empty once finished
        if self._finished():
            return iter(())
        return super().__iter__()


class ElasticTrainerCallback(TrainerCallback):
    """Resume, per-step bookkeeping, drain and checkpoints for an :class:`ElasticTrainer`.

    Args:
        sampler: The trainer's :class:`ElasticSampler`.
        checkpoint_url: fsspec URL; default the agent's ``--checkpoint-url``, else
            ``file://./checkpoints``.
        save_every: Commit a checkpoint every this many steps (a drain and every epoch's
            end always commit).
        keep_last: Checkpoints kept.
    """

    def __init__(self, sampler: ElasticSampler, *, checkpoint_url: str | None, save_every: int,
                 keep_last: int) -> None:
        self.sampler = sampler
        self._checkpoint_url = checkpoint_url
        self._save_every = save_every
        self._keep_last = keep_last
        self.loop: ElasticLoop | None = None
        self.max_steps = 0

    def finished(self) -> bool:
        """Has the job trained all the Trainer's ``max_steps``?"""
        return self.loop is not None and self.loop.steps_done >= self.max_steps

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Load elasticd's newest checkpoint into the model, the Trainer's optimizer and LR
        scheduler and the sampler; the Trainer's step count follows it."""
        self.loop = ElasticLoop({"model": kwargs["model"], "optimizer": kwargs["optimizer"],
                                 "scheduler": kwargs["lr_scheduler"]}, self.sampler,
                                checkpoint_url=self._checkpoint_url, save_every=self._save_every,
                                keep_last=self._keep_last, live=False)
        epoch = self.loop.resume()
        self.max_steps = state.max_steps
        state.global_step = self.loop.steps_done
        log.info("trainer_resumed", steps_done=self.loop.steps_done, epoch=epoch,
                 max_steps=state.max_steps, world_size=self.sampler.num_replicas,
                 accumulation_steps=args.gradient_accumulation_steps)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """One global batch is trained: count it, report it, drain or checkpoint."""
        loop = self.loop
        assert loop is not None, "on_step_end before on_train_begin"
        loop.step_done()  # on a drain: commits this step on every rank and exits 0
        state.global_step = loop.steps_done
        if self.sampler.steps_remaining == 0:
            # The epoch is trained: a resume starts the next one.
            self.sampler.set_epoch(self.sampler.epoch + 1)
            loop.save(blocking=True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Commit the last step and wait for every save."""
        if self.loop is not None:
            self.loop.close()


class ElasticTrainer(Trainer):
    """``transformers.Trainer`` with elasticd's sampler, constant global batch, resume,
    drain and checkpoints (see the module doc).

    Args:
        *args: ``Trainer``'s.
        global_batch_size: Samples per optimizer step over all ranks, at every world size.
            ``per_device_train_batch_size`` becomes the largest micro-batch;
            ``gradient_accumulation_steps`` is chosen per world size.
        checkpoint_url: fsspec URL of elasticd's checkpoints; default the agent's
            ``--checkpoint-url``, else ``file://./checkpoints``.
        save_every: Commit a checkpoint every this many optimizer steps.
        keep_last: elasticd checkpoints kept.
        **kwargs: ``Trainer``'s.

    Raises:
        ConfigError: ``global_batch_size`` missing or < 1, ``save_every`` < 1, or a
            training dataset without a length (an ``IterableDataset``).
    """

    def __init__(self, *args: Any, global_batch_size: int | None = None,
                 checkpoint_url: str | None = None, save_every: int = 50, keep_last: int = 3,
                 **kwargs: Any) -> None:
        if global_batch_size is None or global_batch_size < 1:
            raise ConfigError(f"ElasticTrainer needs global_batch_size >= 1 (samples per optimizer "
                              f"step over all ranks, kept at every world size), got "
                              f"{global_batch_size}; e.g. ElasticTrainer(..., global_batch_size=16)")
        if save_every < 1:
            raise ConfigError(f"save_every must be >= 1, got {save_every}")
        worker.init()  # elasticd forms the process group; Accelerate adopts it
        super().__init__(*args, **kwargs)
        self.global_batch_size = global_batch_size
        self._elastic_options = {"checkpoint_url": checkpoint_url, "save_every": save_every,
                                 "keep_last": keep_last}
        self.elastic: ElasticTrainerCallback | None = None

    def get_train_dataloader(self) -> DataLoader:
        """The training loader over elasticd's sampler, not prepared by Accelerate (which
        would shard it a second time); sets ``gradient_accumulation_steps`` for this world.

        Raises:
            ConfigError: no training dataset, or one without a length.
        """
        dataset = self.train_dataset
        if dataset is None or not hasattr(dataset, "__len__"):
            raise ConfigError("ElasticTrainer needs a train_dataset with a length (a map-style "
                              "dataset): elasticd's sampler shards one permutation of its indices")
        ctx = worker.current_context()
        sampler = ElasticSampler(dataset, global_batch_size=self.global_batch_size,  # type: ignore[arg-type]
                                 seed=self.args.seed)
        plan = plan_global_batch(self.global_batch_size, ctx.world_size,
                                 self.args.per_device_train_batch_size, allow_uneven=True)
        self.args.gradient_accumulation_steps = plan.accumulation_steps
        if self.elastic is not None:
            self.remove_callback(self.elastic)
        self.elastic = ElasticTrainerCallback(sampler, **self._elastic_options)  # type: ignore[arg-type]
        self.add_callback(self.elastic)
        log.info("trainer_batch_planned", global_batch_size=self.global_batch_size,
                 world_size=ctx.world_size, reason=plan.reason)
        collator = self._get_collator_with_removed_columns(self.data_collator, description="training")
        return EpochLoader(dataset, ElasticBatchSampler(sampler, plan), collator,
                           self.elastic.finished, num_workers=self.args.dataloader_num_workers,
                           pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available())
