"""A 3-rank DDP job on ElasticLoop with replica fingerprints; one rank's weight can be nudged
once (a silent divergence, as a flipped bit or an update outside DDP would cause).

Env: OUT (folder: rank<r>.pt = final model state, rank<r>.json = what the fingerprints
saw; one epoch of 20 steps), FP_EVERY (steps between checks), NUDGE_RANK and
NUDGE_STEP (optional: after the optimizer step that makes steps_done NUDGE_STEP, that rank
adds 1e-3 to one weight), CKPT (checkpoint URL).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from elasticd.worker import ElasticDistributedSampler, ElasticLoop, fast_exit, init


def main() -> int:
    ctx = init("gloo")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(240, 20, generator=g), torch.rand(240, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=4, sampler=ElasticDistributedSampler(data, shuffle=False))
    loop = ElasticLoop({"model": model, "optimizer": opt}, loader.sampler,
                       checkpoint_url=os.environ["CKPT"], save_every=10_000,
                       fingerprint_every=int(os.environ["FP_EVERY"]))
    loop.resume()
    ddp = DDP(model)
    nudge_rank = int(os.environ.get("NUDGE_RANK", "-1"))
    nudge_step = int(os.environ.get("NUDGE_STEP", "-1"))
    found_at = None
    for x, y in loop.batches(loader):  # one epoch
        if loop.fingerprints.diverged and found_at is None:
            found_at = loop.steps_done
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        if ctx.rank == nudge_rank and loop.steps_done + 1 == nudge_step:
            with torch.no_grad():
                model.weight[0, 0] += 1e-3
    if loop.fingerprints.diverged and found_at is None:
        found_at = loop.steps_done
    out = os.environ["OUT"]
    torch.save(model.state_dict(), os.path.join(out, f"rank{ctx.rank}.pt"))
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as fh:
        json.dump({"diverged": [list(d) for d in loop.fingerprints.diverged],
                   "found_at": found_at, "steps_done": loop.steps_done}, fh)
    loop.close()
    dist.barrier()
    fast_exit(0)


if __name__ == "__main__":
    sys.exit(main())
