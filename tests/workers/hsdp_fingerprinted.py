"""An HSDP job on ElasticLoop with replica fingerprints: a ("replicate", "shard") mesh of
WORLD_SIZE / LOCAL_WORLD_SIZE replicas; one rank's local shard can be nudged once (a
silent divergence of one replica of that shard).

Env: OUT (folder: rank<r>.pt = this rank's final local shards of parameters and optimizer
state, rank<r>.json = what the fingerprints saw; one epoch of 20 steps), FP_EVERY (steps
between checks), NUDGE_RANK and NUDGE_STEP (optional: after the optimizer step that makes
steps_done NUDGE_STEP, that rank adds 1e-3 to its first local weight), CKPT (checkpoint URL).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from elasticd.worker import ElasticDistributedSampler, ElasticLoop, ShardedModel, fast_exit, init
from elasticd.worker.fingerprint import state_tensors
from elasticd.worker.sharded import local_of


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> int:
    ctx = init("gloo")
    g = torch.Generator().manual_seed(0)
    n = 4 * 20 * ctx.world_size
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    sharded = ShardedModel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double(),
                           parallelize, "hsdp")
    model = sharded.module
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=4, sampler=ElasticDistributedSampler(data, shuffle=False))
    loop = ElasticLoop({"model": model, "optimizer": opt}, loader.sampler, sharded=sharded,
                       checkpoint_url=os.environ["CKPT"], save_every=10_000,
                       fingerprint_every=int(os.environ["FP_EVERY"]))
    loop.resume()
    nudge_rank = int(os.environ.get("NUDGE_RANK", "-1"))
    nudge_step = int(os.environ.get("NUDGE_STEP", "-1"))
    found_at = None
    for xb, yb in loop.batches(loader):  # one epoch
        if loop.fingerprints.diverged and found_at is None:
            found_at = loop.steps_done
        opt.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        opt.step()
        if ctx.rank == nudge_rank and loop.steps_done + 1 == nudge_step:
            with torch.no_grad():
                local_of(model[0].weight)[0, 0] += 1e-3
    if loop.fingerprints.diverged and found_at is None:
        found_at = loop.steps_done
    out = os.environ["OUT"]
    torch.save([t.clone() for t in state_tensors({"model": model, "optimizer": opt})],
               os.path.join(out, f"rank{ctx.rank}.pt"))
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as fh:
        json.dump({"diverged": [list(d) for d in loop.fingerprints.diverged], "found_at": found_at,
                   "steps_done": loop.steps_done, "shard": sharded.coordinate,
                   "check_s": list(loop.fingerprints.check_s)}, fh)
    loop.close()
    dist.barrier()
    fast_exit(0)


if __name__ == "__main__":
    sys.exit(main())
