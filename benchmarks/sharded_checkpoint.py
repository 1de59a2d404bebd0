"""Sharded checkpoint benchmark: how long a sharded save blocks the loop, against DCP.

N gloo processes (default 2) shard an MLP with FSDP2 (``fully_shard``, 1-D mesh) and Adam
(parameters + two moments: the state is 3x the parameters), then alternate, ``--repeats``
times: an elasticd ``CheckpointManager.save`` (async: the time ``save()`` blocks the
caller, every rank copying its own shards into its staging buffers), its commit
(``wait()``), and a synchronous ``torch.distributed.checkpoint.save`` of the same state
(``get_state_dict``, FileSystemWriter, the whole save is what a loop without async waits
for). Figures are the medians after the first save (which allocates the buffers), the
slowest rank's. Goal (issue 23): blocked <= 10 % of the synchronous DCP save.

Then a resharding load (``load_latest`` into a fresh model on the same mesh, read + CRC +
copy) against raw reads of the same shard files.

Run: ``python benchmarks/sharded_checkpoint.py [--mib 256] [--ranks 2] [--repeats 4]
[--dir /tmp]``; prints one JSON line per rank and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(rank: int, world: int, workdir: str, mib: int, repeats: int) -> dict:
    import logging

    import structlog
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elasticd.checkpoint import CheckpointManager

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    store = dist.FileStore(f"{workdir}/store", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    width = 1024
    layers = max(1, (mib << 20) // 3 // 4 // (width * width))  # params + 2 Adam moments, fp32

    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    model, optim = build(0)
    model(torch.randn(4, width)).sum().backward()
    optim.step()
    local = sum(p.to_local().numel() * 4 * 3 for p in model.parameters())
    mgr = CheckpointManager(f"file://{workdir}/ckpt", job="bench", keep_last=2, fence=None)
    blocked, committed, dcp_s = [], [], []
    for step in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(step, {"model": model, "optim": optim})
        t1 = time.perf_counter()
        mgr.wait()
        dist.barrier()
        t2 = time.perf_counter()
        msd, osd = get_state_dict(model, optim)
        t3 = time.perf_counter()
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{workdir}/dcp-{step}")
        t4 = time.perf_counter()
        shutil.rmtree(f"{workdir}/dcp-{step}", ignore_errors=True) if rank == 0 else None
        if step:  # the first save allocates the staging buffers
            blocked.append(t1 - t0)
            committed.append(t2 - t0)
            dcp_s.append(t4 - t3)
    fresh, fresh_optim = build(1)
    dist.barrier()
    t0 = time.perf_counter()
    loaded = mgr.load_latest({"model": fresh, "optim": fresh_optim})
    load_s = time.perf_counter() - t0
    shard_files = sorted(Path(loaded.manifest_url.removeprefix("file://")).parent.glob("shards-r*.bin"))
    t0 = time.perf_counter()
    raw = sum(len(p.read_bytes()) for p in shard_files[rank::world])
    raw_s = time.perf_counter() - t0
    mgr.close()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "local_state_bytes": local,
            "save_blocked_s": statistics.median(blocked), "committed_s": statistics.median(committed),
            "dcp_save_sync_s": statistics.median(dcp_s), "load_s": load_s,
            "raw_read_s": raw_s, "raw_read_bytes": raw}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="total state (params + Adam), MiB")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--dir", default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.ranks, args.workdir, args.mib, args.repeats)), flush=True)
        return 0
    workdir = tempfile.mkdtemp(prefix="elasticd-shardbench-", dir=args.dir)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    try:
        procs = [subprocess.Popen([sys.executable, __file__, "--child", str(r), "--workdir", workdir,
                                   "--ranks", str(args.ranks), "--mib", str(args.mib),
                                   "--repeats", str(args.repeats)],
                                  stdout=subprocess.PIPE, env=env) for r in range(args.ranks)]
        rows = []
        for proc in procs:
            out, _ = proc.communicate(timeout=900)
            if proc.returncode:
                raise SystemExit(f"a rank failed ({proc.returncode})")
            rows.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    blocked = max(r["save_blocked_s"] for r in rows)
    dcp = max(r["dcp_save_sync_s"] for r in rows)
    load = max(r["load_s"] for r in rows)
    raw = max(r["raw_read_s"] for r in rows)
    print(json.dumps({"summary": True, "ranks": args.ranks, "mib": args.mib,
                      "save_blocked_s": round(blocked, 4), "dcp_save_sync_s": round(dcp, 3),
                      "blocked_vs_dcp": round(blocked / dcp, 3),
                      "committed_s": round(max(r["committed_s"] for r in rows), 3),
                      "load_s": round(load, 3), "raw_read_s": round(raw, 3),
                      "load_vs_raw_read": round(raw / load, 3), "load1": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
