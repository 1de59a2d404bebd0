"""Worker for the Hugging Face Trainer exactly-once test: an ``ElasticTrainer`` run.

A 2-layer Llama of width 32 (examples/hf_trainer.py's model) trained by the ``Trainer``
through ``elasticd.integrations.transformers.ElasticTrainer`` on token sequences drawn
from a generator seeded per sample. The collator takes each sample's index out of the
batch (the model never sees it) and a callback appends one ledger row per optimizer step
to ``--trace``, in the format of tests/workers/exactly_once.py: the step, the round it
trained in, the epoch, the world size and the indices this rank trained. The pace is the
test's: while ``--hold`` holds a number ``S`` the worker trains steps before ``S`` and
waits (exactly_once.wait_for_release, a row in ``<trace>.wait``). Run without an agent
(plain ``python``) it is the fault-free reference at world size 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from exactly_once import wait_for_release
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from elasticd.integrations.transformers import ElasticTrainer
from elasticd.worker.context import current_round

VOCAB, SEQ_LEN = 64, 8


class IndexedTokens(Dataset):
    """Sample i: tokens from a generator seeded with i, and i itself for the ledger."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.randint(VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone(), "idx": i}


class Ledger(TrainerCallback):
    """Holds the job at the test's step and writes what each optimizer step trained."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pending: list[int] = []  # indices collated since the last optimizer step
        self.trainer: ElasticTrainer | None = None

    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        self.pending += [int(it["idx"]) for it in items]
        return {k: torch.stack([it[k] for it in items]) for k in ("input_ids", "labels")}

    def _epoch(self) -> int:
        assert self.trainer is not None and self.trainer.elastic is not None
        return int(self.trainer.elastic.sampler.epoch)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wait_for_release(self.args.hold, self.args.trace + ".wait", state.global_step, self._epoch())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Runs before elasticd's callback counts the step: global_step is already one on.
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        row = {"step": state.global_step - 1, "round": current_round(), "epoch": self._epoch(),
               "world_size": world, "rank": rank, "pid": os.getpid(), "idx": self.pending}
        self.pending = []
        with open(self.args.trace, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.args.final_params and not (dist.is_initialized() and dist.get_rank()):
            params = {k: v.detach().clone() for k, v in kwargs["model"].state_dict().items()}
            torch.save(params, self.args.final_params)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset-size", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hold", default="")
    p.add_argument("--checkpoint-url", default=os.environ.get("ELASTICD_CHECKPOINT_URL"))
    p.add_argument("--trace", required=True)
    p.add_argument("--final-params", default="")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config)
    ledger = Ledger(args)
    targs = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=args.micro_batch,
                              num_train_epochs=args.epochs, learning_rate=1e-2, save_strategy="no",
                              report_to="none", logging_strategy="no", seed=0, disable_tqdm=True,
                              remove_unused_columns=False, dataloader_pin_memory=False, use_cpu=True)
    trainer = ElasticTrainer(model=model, args=targs, train_dataset=IndexedTokens(args.dataset_size),
                             data_collator=ledger.collate, callbacks=[ledger],
                             global_batch_size=args.global_batch, checkpoint_url=args.checkpoint_url,
                             save_every=1000)
    ledger.trainer = trainer
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
