"""Worker for the end-to-end input-pipeline test: DataLoader workers, per-sample augmentation.

examples/train.py's loop (constant global batch, accumulation, checkpoints, drain) with the
data coming through ``DataLoader(SeededDataset(...), batch_sampler=PositionedBatchSampler(
ElasticBatchSampler(...)), num_workers=2)``. The augmentation (noise, a random sign flip)
runs in the DataLoader workers from each sample's own generator. ``--trace`` appends, per
step and rank: the positions, sample indices and a hash of each augmented input row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from hold import wait_while_held
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from elasticd import worker
from elasticd.checkpoint import CheckpointManager


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dataset-size", type=int, default=144)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=6)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--checkpoint-url", default=os.environ.get("ELASTICD_CHECKPOINT_URL"))
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hold-below-world", type=int, default=0,
                   help="under an agent, after each step while the world is smaller, wait at "
                        "the step boundary until this node is asked to stop (a joiner's drain), "
                        "at most --hold-max-s: the join happens at a known point, never in a "
                        "race with the end of the job")
    p.add_argument("--hold-max-s", type=float, default=180.0)
    p.add_argument("--hold-file", default="",
                   help="while this file holds a step S, wait (polling, at most --hold-max-s) "
                        "before training step S or a later one: the test releases the job "
                        "(removes the file) after the fault it schedules inside it")
    p.add_argument("--trace", required=True)
    p.add_argument("--final-params", required=True)
    return p.parse_args()


class Augment:
    """Gaussian noise and a random sign flip, drawn from the sample's own generator."""

    def __call__(self, item: tuple[torch.Tensor, torch.Tensor], gen: torch.Generator):
        x, y = item
        x = x + 0.1 * torch.randn(x.shape, generator=gen, dtype=x.dtype)
        if torch.rand((), generator=gen) < 0.5:
            x = -x
        return x, y


class Pairs(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def collate(samples):
    keys, pairs = zip(*samples, strict=True)
    xs, ys = zip(*pairs, strict=True)
    return list(keys), torch.stack(xs), torch.stack(ys)


class KeyedDataset(worker.SeededDataset):
    """SeededDataset that also returns the key, for the trace."""

    def __getitem__(self, key):
        return key, super().__getitem__(key)


def _hold_until_asked_to_stop(max_s: float) -> None:
    """Wait (polling, no collective: the world is too small to need one) until this node's
    agent asks for a stop; the next should_stop() then agrees on it."""
    deadline = time.monotonic() + max_s
    while not worker.stop_requested_locally() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> int:
    args = parse_args()
    ctx = worker.init()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.dataset_size, 8, generator=g, dtype=torch.float64)
    y = torch.tanh(x.sum(1, keepdim=True) / 3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(torch.float64)
    ddp = DDP(model) if dist.is_initialized() else model
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = worker.ElasticSampler(args.dataset_size, global_batch_size=args.global_batch, seed=3)
    plan = worker.plan_global_batch(args.global_batch, ctx.world_size, args.micro_batch,
                                    allow_uneven=True)
    ckpt = CheckpointManager(args.checkpoint_url, job=ctx.job or "local", keep_last=3,
                             fence=worker.agent_fence())
    progress = {"step": 0}
    state = {"model": model, "optim": optim, "sampler": sampler, "extra": progress}
    loaded = ckpt.load_latest(state)
    step = loaded.step + 1 if loaded else 0
    dataset = KeyedDataset(Pairs(x, y), Augment())
    trace = open(args.trace, "a")  # noqa: SIM115
    while step < args.steps:
        epoch = sampler.epoch
        loader = DataLoader(dataset, batch_sampler=worker.PositionedBatchSampler(
            worker.ElasticBatchSampler(sampler, plan)), num_workers=args.num_workers,
            prefetch_factor=2 if args.num_workers else None, collate_fn=collate)
        batches = iter(loader)
        for _ in range(sampler.steps_remaining):
            wait_while_held(args.hold_file, step, args.hold_max_s)
            rows = []
            for sync in worker.accumulation_contexts(ddp, plan):
                keys, xb, yb = next(batches)
                with sync:
                    loss = nn.functional.mse_loss(ddp(xb), yb)
                    (loss * plan.loss_scale(len(xb))).backward()
                rows += [[k.position, k.index, hashlib.sha1(r.numpy().tobytes()).hexdigest()[:16]]
                         for k, r in zip(keys, xb, strict=True)]
            optim.step()
            optim.zero_grad(set_to_none=True)
            sampler.step()
            trace.write(json.dumps({"step": step, "epoch": epoch, "rank": ctx.rank,
                                    "round": ctx.round, "world_size": ctx.world_size,
                                    "rows": rows}) + "\n")
            trace.flush()
            if args.step_sleep:
                time.sleep(args.step_sleep)
            worker.report_progress(step, epoch=epoch)
            progress["step"] = step
            done = step + 1 >= args.steps
            if worker.should_stop(step):
                ckpt.save(step, state, blocking=True)
                ckpt.close()
                del batches  # shut the DataLoader workers down before leaving
                worker.fast_exit(0)
            if done or (step + 1) % args.checkpoint_every == 0:
                ckpt.save(step, state, blocking=done)
            if ctx.under_agent and ctx.world_size < args.hold_below_world and not done:
                _hold_until_asked_to_stop(args.hold_max_s)
            step += 1
            if done:
                break
        else:
            sampler.set_epoch(epoch + 1)
        del batches
    ckpt.close()
    if ctx.rank == 0:
        torch.save({k: v.detach() for k, v in model.state_dict().items()}, args.final_params)
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
