"""A DDP job on ElasticLoop with live re-formation and replica fingerprints every 5 steps;
with ``NUDGE=1`` in its environment (one node's) every rank of the node nudges a weight
after step ``10k + 2``, twice per worker process, so that node diverges twice in a row
(and twice again each time its workers start anew after a quarantine).

Trains until it is stopped (``elasticd stop``: the test's event; the loop saves and exits 0
at the agreed step), never to a step count.
Env: CKPT (checkpoint URL).
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from elasticd.worker import ElasticDistributedSampler, ElasticLoop, init, shutdown


def main() -> int:
    init("gloo")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(200_000, 20, generator=g), torch.rand(200_000, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sampler = ElasticDistributedSampler(data, seed=1)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    loop = ElasticLoop({"model": model, "optimizer": opt}, sampler, checkpoint_url=os.environ["CKPT"],
                       save_every=10_000, fingerprint_every=5, live=True)
    first_epoch = loop.resume()
    ddp = loop.ddp(model)
    nudges = 2 if os.environ.get("NUDGE") == "1" else 0
    for epoch in range(first_epoch, 1000):
        sampler.set_epoch(epoch)
        for x, y in loop.batches(loader):
            with loop.guard():
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()
                if nudges and loop.steps_done % 10 == 2:
                    nudges -= 1
                    with torch.no_grad():
                        model.weight[0, 0] += 1e-3
    loop.close()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
