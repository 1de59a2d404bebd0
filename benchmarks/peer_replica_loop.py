"""Steady-state cost of the peer-RAM replica inside a training loop, with an A/A control.

Two gloo processes (one "node" each: rank r's replica is held by rank 1 - r), an FSDP2 MLP
over a 1-D mesh with Adam, trained on random batches. Three arms run in interleaved blocks
of ``--block`` steps, in the order A, replica, B, for ``--rounds`` rounds:

- ``A`` and ``B``: no replica (B is A again: the spread between them is the noise floor);
- ``replica``: ``PeerReplica.refresh`` every ``--k`` steps, exactly as ``LiveState`` does it
  (``peer_reshard.replica_state`` of model and optimizer, the host copy on the loop, the
  CRCs and the TCP exchange in the background thread, competing with the step for CPU).

It prints the median step time per arm (the slower rank's block time / block steps), the
replica's overhead against A, and the A/A spread (B against A)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peer_replica_loop.py --mib 32 --k 25 --block 50 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elasticd.checkpoint import rng
from elasticd.worker.peer_replica import PeerReplica
from elasticd.worker.peer_reshard import replica_state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    width = 1024
    layers = max(1, args.mib * (1 << 20) // 4 // (width * width))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    state = {"model": model, "optim": optim, "progress": {"step": 0}}
    replica = PeerReplica(rank, [1, 0], dist.distributed_c10d._get_default_store(), "127.0.0.1",
                          every_steps=args.k, prefix="bench/peer")
    x = torch.randn(args.batch, width)
    step = 0
    times: dict[str, list[float]] = {"A": [], "replica": [], "B": []}
    for _ in range(args.rounds):
        for arm in ("A", "replica", "B"):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.block):
                optim.zero_grad()
                model(x).square().mean().backward()
                optim.step()
                step += 1
                state["progress"]["step"] = step
                if arm == "replica" and replica.due(step):
                    tensors, extra = replica_state(state, model, names, params, rng.capture())
                    replica.refresh(step, tensors, extra)
            replica.wait()  # the block's last refresh is charged to the replica arm
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[arm].append(float(elapsed) / args.block)
    assert replica.error is None, replica.error
    if rank == 0:
        shard_mib = sum(p.to_local().numel() * 4 for p in params) * 3 / (1 << 20)  # + 2 Adam moments
        med = {arm: statistics.median(v) for arm, v in times.items()}
        with open(out, "w") as f:
            json.dump({"shard_mib_per_rank": round(shard_mib, 1), "k": args.k, "block": args.block,
                       "rounds": args.rounds, "step_s": {a: round(v, 4) for a, v in med.items()},
                       "replica_overhead_pct": round(100 * (med["replica"] / med["A"] - 1), 2),
                       "aa_spread_pct": round(100 * (med["B"] / med["A"] - 1), 2),
                       "blocks": {a: [round(t, 4) for t in v] for a, v in times.items()}}, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32, help="parameters in MiB (fp32), whole model")
    ap.add_argument("--k", type=int, default=25, help="refresh every k steps")
    ap.add_argument("--block", type=int, default=50, help="steps per arm and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    out = f"/tmp/peer_replica_loop_{os.getpid()}.json"
    mp.spawn(_run, args=(args, _free_port(), out), nprocs=2, join=True)
    with open(out) as f:
        print(f.read())
    os.unlink(out)


if __name__ == "__main__":
    main()
