"""Gloo worker for the first-loss check: a checkpoint that loads but trains to an infinite loss.

Two ranks fit a float64 linear model, averaging their gradients with an all-reduce (what
DDP does), report each step's loss and save every SAVE_EVERY steps. With POISON_AT=S, the
first attempt (restart count 0) blows one weight up to 1e200 before the save of step S
(finite, so every CRC and finiteness check passes; its square overflows the loss to inf),
commits it and SIGKILLs itself: the next attempt loads that save and its first loss is
infinite. Env: OUT (one JSON line per rank and step), STEPS, SAVE_EVERY, POISON_AT, FINAL
(rank 0 writes the final parameters there).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

N, FEATURES = 64, 4


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, FEATURES, generator=g, dtype=torch.float64)
    return x, x @ torch.arange(1.0, FEATURES + 1, dtype=torch.float64).unsqueeze(1)


def model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1, dtype=torch.float64)


def share(step: int, rank: int, world: int) -> torch.Tensor:
    """The samples rank ``rank`` trains at ``step``: 8 of them, all ranks together 8 x world."""
    base = (step * world + rank) * 8
    return torch.arange(base, base + 8) % N


def reference(steps: int, world: int) -> dict[str, torch.Tensor]:
    """The fault-free run's final parameters, computed in one process."""
    x, y = data()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            idx = share(step, rank, world)
            (torch.nn.functional.mse_loss(m(x[idx]), y[idx]) / world).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def main() -> int:
    import torch.distributed as dist

    from elasticd import worker
    from elasticd.checkpoint import CheckpointManager

    ctx = worker.init(backend="gloo")
    steps = int(os.environ.get("STEPS", "20"))
    every = int(os.environ.get("SAVE_EVERY", "5"))
    poison_at = int(os.environ.get("POISON_AT", "-1"))
    x, y = data()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    ckpt = CheckpointManager(os.environ["ELASTICD_CHECKPOINT_URL"], job=ctx.job or "local",
                             keep_last=5, fence=worker.agent_fence())
    state = {"model": m, "optim": opt}
    loaded = ckpt.load_latest(state)
    step = loaded.step + 1 if loaded else 0
    while step < steps:
        opt.zero_grad()
        idx = share(step, ctx.rank, ctx.world_size)
        loss = torch.nn.functional.mse_loss(m(x[idx]), y[idx])
        loss.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        opt.step()
        with open(os.environ["OUT"], "a") as fh:
            fh.write(json.dumps({"step": step, "rank": ctx.rank, "restart": ctx.restart_count,
                                 "loss": loss.item(), "pid": os.getpid()}) + "\n")
        worker.report_progress(step, loss=loss.item())  # the first after a restore is judged
        if (step + 1) % every == 0:
            if step == poison_at and ctx.restart_count == 0:
                with torch.no_grad():
                    m.weight[0, 0] = 1e200
                ckpt.save(step, state, blocking=True)
                dist.barrier()  # both ranks' parts committed
                os.kill(os.getpid(), signal.SIGKILL)  # the node's worker crashes
            ckpt.save(step, state, blocking=True)
        step += 1
    ckpt.close()
    if ctx.rank == 0 and os.environ.get("FINAL"):
        torch.save({k: v.detach() for k, v in m.state_dict().items()}, os.environ["FINAL"])
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
