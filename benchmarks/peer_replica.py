"""Cost of the peer-RAM replica's refresh: the blocking snapshot and the background exchange.

One process, a 1-rank gloo mesh, a float64 FSDP-like state of ``--mib`` MiB split into
tensors of ``--layer-mib`` MiB. Per repetition it times (a) ``take_snapshot(crc=False)`` (the only part
that blocks the training loop; the CRCs are computed in the refresh thread), (b) the exchange of two ranks' snapshots over the TCP
transport on loopback (two PeerReplica objects in threads: the bytes a refresh puts on the
network). With ``--step-ms`` it prints the overhead per step of a refresh every k steps,
(a) / (k * step), for k in 1, 5, 10, 20.

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peer_replica.py --mib 256 --reps 5 --step-ms 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from elasticd.worker.peer_replica import PeerReplica, take_snapshot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--layer-mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=200.0)
    args = ap.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    rows = args.layer_mib * (1 << 20) // 8 // 1024
    tensors = {f"layer{i}": distribute_tensor(torch.randn(rows, 1024, dtype=torch.float64), mesh, [Shard(0)])
               for i in range(max(1, args.mib // args.layer_mib))}
    snap_s, xfer_s = [], []
    for rep in range(args.reps):
        t0 = time.perf_counter()
        snaps = [take_snapshot(r, rep, tensors, {"sampler": {"samples": rep}}, crc=False) for r in (0, 1)]
        snap_s.append((time.perf_counter() - t0) / 2)
        store = dist.HashStore()
        reps = [PeerReplica(r, [1, 0], store, "127.0.0.1") for r in (0, 1)]
        threads = [threading.Thread(target=p._exchange, args=(s,)) for p, s in zip(reps, snaps, strict=True)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        xfer_s.append(time.perf_counter() - t0)
        assert all(p.error is None for p in reps), [p.error for p in reps]
        assert torch.equal(reps[0].held[1].data, snaps[1].data)
    snap, xfer = statistics.median(snap_s), statistics.median(xfer_s)
    total = sum(t.to_local().numel() * 8 for t in tensors.values())
    out = {"shard_mib": total / (1 << 20), "snapshot_s": round(snap, 4), "exchange_s": round(xfer, 4),
           "exchange_mib_s_per_rank": round(total / (1 << 20) / xfer, 1),
           "blocking_overhead_pct_by_k": {k: round(100 * snap / (k * args.step_ms / 1000), 2)
                                          for k in (1, 5, 10, 20, 25)}}
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
