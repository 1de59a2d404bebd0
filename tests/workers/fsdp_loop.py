"""Worker for the ElasticLoop sharded live test: a pure FSDP2 model under
``ElasticLoop(sharded=ShardedModel(..., "fsdp"), live=True, peer_replica_every=k)``.

One JSON line per step attempt and rank to ``--trace``: the loop's step index, round,
world size, PID and the dataset indices this rank trained in it. ``--hold-file``: while
that file holds a step S, every rank of a world of 2 or more waits before its step S or
a later one (polling, at most 180 s), so a fault the test schedules lands inside the job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from hold import wait_while_held
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from elasticd import worker


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dataset-size", type=int, default=48)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.25)
    p.add_argument("--peer-replica-every", type=int, default=4)
    p.add_argument("--trace", required=True)
    p.add_argument("--hold-file", default="")
    args = p.parse_args()
    worker.init()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.dataset_size, 4, generator=g, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True)
    dataset = TensorDataset(torch.arange(args.dataset_size), x, y)
    sharded = worker.ShardedModel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double(),
                                  parallelize, "fsdp")
    optim = torch.optim.Adam(sharded.module.parameters(), lr=1e-2)
    sampler = worker.ElasticDistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    loop = worker.ElasticLoop({"model": sharded.module, "optim": optim}, sampler, live=True,
                              sharded=sharded, peer_replica_every=args.peer_replica_every,
                              save_every=1000)
    with open(args.trace, "a") as trace:
        for epoch in range(loop.resume(), args.epochs):
            sampler.set_epoch(epoch)
            for idx, xb, yb in loop.batches(loader):
                if worker.current_context().world_size > 1:  # a node alone never holds
                    wait_while_held(args.hold_file, loop.steps_done)
                with loop.guard():
                    model = loop.model
                    optim.zero_grad()
                    F.mse_loss(model(xb), yb).backward()
                    optim.step()
                    now = worker.current_context()
                    trace.write(json.dumps({"rank": now.rank, "world": now.world_size, "round": now.round,
                                            "step": loop.steps_done, "epoch": epoch, "pid": os.getpid(),
                                            "samples": idx.tolist()}) + "\n")
                    trace.flush()
                time.sleep(args.step_sleep)
    loop.close()
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
