"""Sharded checkpoint benchmark: how long a sharded save blocks the loop, against DCP.

N gloo processes (default 2) shard an MLP with FSDP2 (``fully_shard``, 1-D mesh) and Adam
(parameters + two moments: the state is 3x the parameters), then alternate, ``--repeats``
times: an elasticd ``CheckpointManager.save`` (async: the time ``save()`` blocks the
caller, every rank copying its own shards into its staging buffers), its commit
(``wait()``), and a synchronous ``torch.distributed.checkpoint.save`` of the same state
(``get_state_dict``, FileSystemWriter, the whole save is what a loop without async waits
for). Figures are the medians after the first save (which allocates the buffers), the
slowest rank's. Goal (issue 23): blocked <= 10 % of the synchronous DCP save.

Then a load (``load_latest`` into a fresh model on the same mesh, read + CRC + copy) against
raw reads of the same shard files; with ``--reshard-to M``, a load of the last save at M
ranks (a new mesh: every box read and reassembled) beside DCP's load of its own last save
at M ranks and two raw reads of as many bytes, the slowest rank's: ``readinto`` one buffer
allocated and touched beforehand (page-cache copy speed), and ``readinto`` a fresh buffer per
file (what any load pays: the page faults of new memory; on the 2-core VM fresh memory
fills at ~2 GB/s against ~10 GB/s for a touched buffer). The three load arms run
``--load-trials`` times each in a rotating order (medians; the first elasticd load, which
finds the files, is not counted), and with ``--cold`` every arm starts with the checkpoints
evicted from the page cache (``posix_fadvise(DONTNEED)``: read from the disk, as a node
after a restart reads them).

Run: ``python benchmarks/sharded_checkpoint.py [--mib 256] [--ranks 2] [--repeats 4]
[--dir /tmp] [--reshard-to M] [--load-trials 3] [--cold]``; prints one JSON line per rank and a summary line.
"""

from __future__ import annotations

import argparse
import cProfile
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROFILE_ENV = "ELASTICD_BENCH_PROFILE_DIR"  # set by --profile for the children


def _group(rank: int, world: int, workdir: str, mib: int, store_name: str):
    """Join a gloo group of ``world`` (a FileStore in ``workdir``); the model builder on its
    1-D mesh: an fp32 MLP of ``mib`` MiB with Adam (params + 2 moments), FSDP2 per layer."""
    import logging

    import structlog
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    store = dist.FileStore(f"{workdir}/{store_name}", world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    width = 1024
    layers = max(1, (mib << 20) // 3 // 4 // (width * width))

    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    return build


def _timed_load(mgr, build) -> tuple[float, Any, list[Path]]:
    """Seconds of ``mgr.load_latest`` into a freshly built model and Adam (after a barrier),
    what it loaded, and that checkpoint's shard data files."""
    import torch.distributed as dist

    fresh, fresh_optim = build(1)
    profile_dir = os.environ.get(PROFILE_ENV)
    prof = cProfile.Profile() if profile_dir else None
    dist.barrier()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    loaded = mgr.load_latest({"model": fresh, "optim": fresh_optim})
    load_s = time.perf_counter() - t0
    if prof is not None and profile_dir:
        prof.disable()
        prof.dump_stats(os.path.join(profile_dir, f"load-w{dist.get_world_size()}-r{dist.get_rank()}.prof"))
    return load_s, loaded, sorted(Path(loaded.manifest_url.removeprefix("file://")).parent.glob("shards-r*.bin"))


def child(rank: int, world: int, workdir: str, mib: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from elasticd.checkpoint import CheckpointManager

    build = _group(rank, world, workdir, mib, "store")
    model, optim = build(0)
    model(torch.randn(4, model[0].in_features)).sum().backward()
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
        if rank == 0 and step < repeats:  # the last is kept for the reshard arm
            shutil.rmtree(f"{workdir}/dcp-{step}", ignore_errors=True)
        if step:  # the first save allocates the staging buffers
            blocked.append(t1 - t0)
            committed.append(t2 - t0)
            dcp_s.append(t4 - t3)
    load_s, _, shard_files = _timed_load(mgr, build)
    t0 = time.perf_counter()
    raw = sum(len(p.read_bytes()) for p in shard_files[rank::world])
    raw_s = time.perf_counter() - t0
    mgr.close()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "local_state_bytes": local,
            "save_blocked_s": statistics.median(blocked), "committed_s": statistics.median(committed),
            "dcp_save_sync_s": statistics.median(dcp_s), "load_s": load_s,
            "raw_read_s": raw_s, "raw_read_bytes": raw}


def _evict(root: str) -> None:
    """Drop every file under ``root`` from the page cache (flushed first: only clean pages
    can go), so that the next read comes from the disk, as after a node's restart."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _raw_fresh_read(files: list[Path], lo: int, hi: int) -> float:
    """Seconds to read bytes ``lo:hi`` of the concatenated ``files`` into fresh buffers, one
    per file (what any load must do: the page faults of new memory)."""
    t0 = time.perf_counter()
    fresh, pos = [], 0
    for f in files:
        size = f.stat().st_size
        a, b = max(lo, pos), min(hi, pos + size)
        if a < b:
            part = bytearray(b - a)
            with open(f, "rb", buffering=0) as fh:
                fh.seek(a - pos)
                view, at = memoryview(part), 0
                while at < b - a and (n := fh.readinto(view[at:])):
                    at += n
            fresh.append(part)
        pos += size
    return time.perf_counter() - t0


def reshard_child(rank: int, world: int, workdir: str, mib: int, repeats: int,
                  trials: int = 1, cold: bool = False) -> dict:
    """Load, at ``world`` ranks, the last save of the first phase, ``trials`` times in a
    rotating order of three arms: elasticd's resharding load, DCP's (``dcp.load`` of the last
    DCP save, then ``set_state_dict``), and a raw read of as many bytes of the shard files (a
    contiguous 1/world of them) into fresh buffers; medians per arm. With ``cold``, every
    arm starts with the checkpoints out of the page cache (read from the disk). Then once a
    raw read into one buffer touched beforehand, from the page cache (its copy speed)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from elasticd.checkpoint import CheckpointManager

    build = _group(rank, world, workdir, mib, "store-reshard")
    mgr = CheckpointManager(f"file://{workdir}/ckpt", job="bench", keep_last=2, fence=None)
    dcp_dir = f"{workdir}/dcp-{repeats}"
    ours: list[float] = []
    theirs: list[float] = []
    fresh_s: list[float] = []
    files: list[Path] = []
    saved_world = 0
    span = (0, 0)

    def elasticd_arm() -> None:
        nonlocal files, saved_world, span
        load_s, loaded, files = _timed_load(mgr, build)
        ours.append(load_s)
        saved_world = loaded.world_size
        total = sum(f.stat().st_size for f in files)
        span = (total * rank // world, total * (rank + 1) // world)

    def dcp_arm() -> None:
        other, other_optim = build(2)
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(other, other_optim)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
        set_state_dict(other, other_optim, model_state_dict=msd, optim_state_dict=osd)
        theirs.append(time.perf_counter() - t0)

    def raw_arm() -> None:
        dist.barrier()
        fresh_s.append(_raw_fresh_read(files, *span))

    elasticd_arm()  # the first load also finds the files and this rank's span of them
    ours.clear()
    arms = [elasticd_arm, dcp_arm, raw_arm]
    for trial in range(trials):
        for arm in arms[trial % 3:] + arms[:trial % 3]:
            if cold:
                if rank == 0:
                    _evict(workdir)
                dist.barrier()
            arm()
    lo, hi = span
    buf = bytearray(hi - lo)
    view, at, pos = memoryview(buf), 0, 0
    t0 = time.perf_counter()
    for f in files:
        size = f.stat().st_size
        a, b = max(lo, pos), min(hi, pos + size)
        if a < b:
            with open(f, "rb", buffering=0) as fh:
                fh.seek(a - pos)
                while at < b - lo:
                    n = fh.readinto(view[at:b - lo])
                    if not n:
                        break
                    at += n
        pos += size
    raw_s = time.perf_counter() - t0
    del buf, view
    mgr.close()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "reshard_load_s": statistics.median(ours),
            "dcp_reshard_load_s": statistics.median(theirs), "raw_read_s": raw_s,
            "raw_fresh_read_s": statistics.median(fresh_s), "raw_read_bytes": hi - lo,
            "saved_world": saved_world, "trials": {"elasticd": ours, "dcp": theirs, "raw_fresh": fresh_s}}


def _spawn(args: argparse.Namespace, workdir: str, env: dict, mode: str, world: int) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, __file__, mode, str(r), "--workdir", workdir,
                               "--ranks", str(world), "--mib", str(args.mib),
                               "--repeats", str(args.repeats), "--load-trials", str(args.load_trials)]
                              + (["--cold"] if args.cold else []),
                              stdout=subprocess.PIPE, env=env) for r in range(world)]
    rows = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode:
            raise SystemExit(f"a rank failed ({proc.returncode})")
        rows.append(json.loads(out.decode().strip().splitlines()[-1]))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="total state (params + Adam), MiB")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--dir", default=None)
    p.add_argument("--reshard-to", type=int, default=0, metavar="M",
                   help="then load the last save at M ranks (elasticd, DCP, raw reads)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a cProfile of each rank's elasticd load to DIR "
                        "(load-w<world>-r<rank>.prof; read with python -m pstats)")
    p.add_argument("--load-trials", type=int, default=3, metavar="N",
                   help="with --reshard-to: each load arm N times, in a rotating order (medians)")
    p.add_argument("--cold", action="store_true",
                   help="with --reshard-to: evict the checkpoints from the page cache before "
                        "every load arm (reads from the disk, as after a restart)")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reshard-child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.ranks, args.workdir, args.mib, args.repeats)), flush=True)
        return 0
    if args.reshard_child is not None:
        print(json.dumps(reshard_child(args.reshard_child, args.ranks, args.workdir, args.mib,
                                       args.repeats, args.load_trials, args.cold)), flush=True)
        return 0
    workdir = tempfile.mkdtemp(prefix="elasticd-shardbench-", dir=args.dir)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        env[PROFILE_ENV] = os.path.abspath(args.profile)
    reshard: list[dict] = []
    try:
        rows = _spawn(args, workdir, env, "--child", args.ranks)
        if args.reshard_to:
            reshard = _spawn(args, workdir, env, "--reshard-child", args.reshard_to)
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
    if reshard:
        for row in reshard:
            trials = {k: [round(v, 4) for v in vs] for k, vs in row.pop("trials").items()}
            print(json.dumps({**{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                              "trials": trials}))
        ours = max(r["reshard_load_s"] for r in reshard)
        theirs = max(r["dcp_reshard_load_s"] for r in reshard)
        raw = max(r["raw_read_s"] for r in reshard)
        fresh = max(r["raw_fresh_read_s"] for r in reshard)
        print(json.dumps({"summary": "reshard", "saved_ranks": args.ranks, "load_ranks": args.reshard_to,
                          "cold": args.cold, "load_trials": args.load_trials,
                          "reshard_load_s": round(ours, 3), "dcp_reshard_load_s": round(theirs, 3),
                          "raw_read_s": round(raw, 3), "reshard_vs_raw_read": round(raw / ours, 3),
                          "raw_fresh_read_s": round(fresh, 3),
                          "reshard_vs_raw_fresh_read": round(fresh / ours, 3),
                          "reshard_vs_dcp": round(theirs / ours, 3), "load1": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
