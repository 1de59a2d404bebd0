"""Worker for the exactly-once tests: ``ElasticLoop`` over one of the documented pipelines.

A float64 linear model trained with SGD over a dataset that returns each sample's index.
After every optimizer step each rank appends one ledger row to ``--trace``: the step, the
round it trained in, the epoch, the world size and the sample indices it trained. The
pipeline is chosen with ``--pipeline``:

- ``batch-sampler``: ``ElasticSampler`` + ``ElasticBatchSampler`` with a plan made at start
  (``plan_global_batch(G, world size at start, G, allow_uneven=True)``): one loader batch is
  one optimizer step, the global batch is constant.
- ``distributed``: ``ElasticDistributedSampler`` in a ``DataLoader(batch_size=b)``.
- ``distributed-drop-last``: the same with ``DataLoader(drop_last=True)``.

The test controls the pace with a file, never with a step count: while ``--hold`` exists
and holds a number ``S``, the worker trains steps before ``S`` and then waits (appending a
``waiting`` row to ``<trace>.wait`` once per step and round) until the number grows or
the file is removed; it trains ``--epochs`` epochs. Run without an agent (plain ``python``) it is the fault-free
reference at world size 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from elasticd import worker
from elasticd.worker.context import current_round


class Indexed(Dataset):
    """(index, x, y): the index travels with the sample into the ledger."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=g, dtype=torch.float64)
        self.y = torch.randn(size, 1, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--pipeline", required=True,
                   choices=["batch-sampler", "distributed", "distributed-drop-last"])
    p.add_argument("--dataset-size", type=int, default=96)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4, help="per rank (distributed pipelines)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--live", action="store_true")
    p.add_argument("--hold", default="", help="file holding the first step not to train yet")
    p.add_argument("--checkpoint-url", default=os.environ.get("ELASTICD_CHECKPOINT_URL"))
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--trace", required=True)
    p.add_argument("--final-params", default="")
    return p.parse_args()


def _limit(hold: str) -> int | None:
    try:
        with open(hold) as f:
            return int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):  # removed, or caught mid-write: read again
        return None if not os.path.exists(hold) else -1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0  # it changes on a re-formation


def wait_for_release(hold: str, status: str, step: int, epoch: int) -> None:
    """Wait while the hold file says ``step`` may not be trained yet; say so once."""
    said = False
    while hold:
        limit = _limit(hold)
        if limit is None or step < limit:
            return
        if not said:
            world = dist.get_world_size() if dist.is_initialized() else 1
            with open(status, "a") as f:
                f.write(json.dumps({"waiting": step, "epoch": epoch, "rank": _rank(),
                                    "world_size": world, "round": current_round()}) + "\n")
            said = True
        time.sleep(0.02)  # polling the test's file: the test decides when the job goes on


def main() -> int:
    args = parse_args()
    ctx = worker.init()  # ctx.rank and ctx.world_size are the start's
    torch.manual_seed(0)
    dataset = Indexed(args.dataset_size)
    model = torch.nn.Linear(8, 1).to(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if args.pipeline == "batch-sampler":
        sampler = worker.ElasticSampler(dataset, global_batch_size=args.global_batch, seed=1)
        plan = worker.plan_global_batch(args.global_batch, ctx.world_size, args.global_batch,
                                        allow_uneven=True)
        batches = worker.ElasticBatchSampler(sampler, plan)
        loader = DataLoader(dataset, batch_sampler=batches)
    else:
        sampler = worker.ElasticDistributedSampler(dataset, seed=1)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                            drop_last=args.pipeline == "distributed-drop-last")
    loop = worker.ElasticLoop({"model": model, "optimizer": optimizer}, sampler,
                              checkpoint_url=args.checkpoint_url, save_every=args.save_every,
                              live=args.live)
    first_epoch = loop.resume()
    ddp = loop.ddp(model)
    with open(args.trace, "a") as trace:
        for epoch in range(first_epoch, args.epochs):
            sampler.set_epoch(epoch)
            for idx, x, y in loop.batches(loader):
                wait_for_release(args.hold, args.trace + ".wait", loop.steps_done, epoch)
                with loop.guard():
                    optimizer.zero_grad()
                    loss = F.mse_loss(ddp(x), y)
                    if args.pipeline == "batch-sampler":
                        loss = loss * batches.plan.loss_scale(len(x))
                    loss.backward()
                    optimizer.step()
                    world = dist.get_world_size() if dist.is_initialized() else 1
                    row = {"step": loop.steps_done, "round": current_round(),
                           "epoch": epoch, "world_size": world, "rank": _rank(),
                           "pid": os.getpid(), "idx": idx.tolist()}
                    trace.write(json.dumps(row) + "\n")
                    trace.flush()
    loop.close()
    if args.final_params and _rank() == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.final_params)
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
