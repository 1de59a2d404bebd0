"""Worker for the Lightning exactly-once test: a Lightning ``Trainer`` with ``ElasticCallback``.

The ledger and the pace are those of tests/workers/exactly_once.py (its ``Indexed`` dataset
and ``wait_for_release``): the dataset returns each sample's index, every micro-batch
appends a ledger row to ``--trace`` (the step of the job it belongs to, the round, the
epoch, the world size, the indices), and before the first micro-batch of each optimizer
step the worker waits while the ``--hold`` file forbids that step. A float64 linear model,
SGD, a constant global batch (``--global-batch`` samples per step, micro-batches of at
most ``--max-micro-batch``: gradient accumulation follows the world size). Run without an
agent (plain ``python``) it is the fault-free reference at world size 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exactly_once import Indexed, wait_for_release  # noqa: E402 - the matrix worker's ledger and pace

from elasticd.integrations.lightning import ElasticCallback  # noqa: E402
from elasticd.worker.context import current_round  # noqa: E402


class Ledgered(L.LightningModule):
    """Linear regression that writes what it trains to the ledger."""

    def __init__(self, elastic: ElasticCallback, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1).to(torch.float64)
        self.elastic, self.args = elastic, args

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if batch_idx % self.trainer.accumulate_grad_batches == 0:  # the first micro-batch of a step
            assert self.elastic.sampler is not None
            wait_for_release(self.args.hold, self.args.trace + ".wait", self.elastic.steps_done,
                             int(self.elastic.sampler.epoch))

    def training_step(self, batch, batch_idx: int):
        idx, x, y = batch
        assert self.elastic.sampler is not None
        row = {"step": self.elastic.steps_done, "round": current_round(),
               "epoch": int(self.elastic.sampler.epoch),
               "world_size": dist.get_world_size() if dist.is_initialized() else 1,
               "rank": dist.get_rank() if dist.is_initialized() else 0,
               "pid": os.getpid(), "idx": idx.tolist()}
        with open(self.args.trace, "a") as trace:
            trace.write(json.dumps(row) + "\n")
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset-size", type=int, default=96)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--max-micro-batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hold", default="", help="file holding the first step not to train yet")
    p.add_argument("--checkpoint-url", default=None)
    p.add_argument("--trace", required=True)
    p.add_argument("--final-params", default="")
    args = p.parse_args()
    dataset = Indexed(args.dataset_size)
    elastic = ElasticCallback(global_batch_size=args.global_batch, max_micro_batch=args.max_micro_batch,
                              seed=1, save_every=1000, checkpoint_url=args.checkpoint_url)
    loader = DataLoader(dataset, batch_sampler=elastic.batch_sampler(dataset))
    model = Ledgered(elastic, args)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, strategy="ddp",
                        precision="64-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[elastic], plugins=[elastic.environment()],
                        use_distributed_sampler=False)
    trainer.fit(model, loader)
    if args.final_params and trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.net.state_dict().items()}, args.final_params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
