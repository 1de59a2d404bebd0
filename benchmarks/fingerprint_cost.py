"""Cost of HSDP replica fingerprints as a fraction of step time.

``--replicas`` x ``--shards`` gloo ranks on 127.0.0.1 (``torch.multiprocessing``), an
HSDP ``ShardedModel`` (3 layers of ``--width``, float32, Adam) on the elasticd mesh. Each
rank trains ``--steps`` steps; on every step after the warm-up it times the step (forward,
backward, Adam) and, apart from it, one fingerprint check
(``ReplicaFingerprints.check``: hash of the local shards of parameters and Adam state,
one all-gather of three int64 per rank, the per-shard judgement). Checks and steps
alternate, so the load of a shared machine hits both alike.

Reported (rank 0's clock, JSON): median step time, median check time, the check's share of
one step (a check every step), the cadence ``fingerprint_every=None`` picks from them
(``cadence_steps``: <= 0.5 % of step time) and the share at that cadence.

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fingerprint_cost.py --width 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

from elasticd.etcd.embedded import free_port


def _rank(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.replicas * args.shards),
                       "LOCAL_RANK": str(rank % args.shards), "LOCAL_WORLD_SIZE": str(args.shards),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    for key in ("ELASTICD_CONTROL_SOCKET", "ELASTICD_LIVE", "ELASTICD_ROUND"):
        os.environ.pop(key, None)
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from elasticd.worker import ShardedModel, init
    from elasticd.worker.fingerprint import ReplicaFingerprints, cadence_steps, hsdp_replicas

    def parallelize(model: nn.Module, mesh: object) -> nn.Module:
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    init("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = args.width
    sharded = ShardedModel(nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                                         nn.Linear(w, 1)), parallelize, "hsdp")
    model = sharded.module
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    fp = ReplicaFingerprints({"model": model, "optimizer": opt}, {}, every=1,
                             replicas=hsdp_replicas(sharded), report=lambda _: None)
    x, y = torch.randn(args.batch, w), torch.randn(args.batch, 1)
    steps, checks = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        t1 = time.perf_counter()
        fp.check(i + 1)
        t2 = time.perf_counter()
        if i >= args.warmup:
            steps.append(t1 - t0)
            checks.append(t2 - t1)
    if rank == 0:
        step, check = statistics.median(steps), statistics.median(checks)
        every = cadence_steps(check, step)
        params = sum(p.numel() for p in model.parameters())
        with open(out, "w") as fh:
            json.dump({"replicas": args.replicas, "shards": args.shards, "width": w,
                       "params": params, "batch": args.batch, "steps_timed": len(steps),
                       "step_s": step, "check_s": check, "share_every_step": check / step,
                       "auto_every": every, "share_at_auto": check / (every * step)}, fh)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, (args, free_port(), out), nprocs=args.replicas * args.shards)
        with open(out) as fh:
            print(json.dumps(json.load(fh)))


if __name__ == "__main__":
    main()
