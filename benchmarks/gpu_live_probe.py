"""gpu_check step d: the mechanism of live re-formation on NCCL (or gloo), in 2-3 processes.

What elasticd does on a membership change, reduced to its communicator operations:

1. rank 0 and rank 1 train (all-reduce a model-sized buffer) in a group;
2. rank 1 is SIGKILLed mid-training;
3. rank 0's collective with it does not fail by itself on NCCL (its peer's sockets die,
   but NCCL waits for the watchdog's timeout); a watcher thread aborts the group, as
   ``elasticd.worker.live`` does once the agent orders the next round: the time from the
   kill to the main thread's error is measured;
4. rank 0 forms a new group with a fresh joiner (new TCPStore, a new port) and sends it
   the model with ``broadcast_state`` (no storage read); the joiner checks every byte and
   both run an all-reduce in the new group.

With fewer than 2 GPUs (NCCL refuses two ranks on one device) it runs steps 1, 3 and 4 on
one rank and no joiner: abort of a live NCCL group, then a new group of one. Prints one
JSON object.

Usage::

    PYTHONPATH=$PWD python benchmarks/gpu_live_probe.py --backend nccl --mib 512
    PYTHONPATH=$PWD python benchmarks/gpu_live_probe.py --backend gloo --mib 16   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(backend: str, port: int, rank: int, world: int, device: Any) -> None:
    import torch.distributed as dist

    kw: dict[str, Any] = {"backend": backend, "init_method": f"tcp://127.0.0.1:{port}", "rank": rank,
                          "world_size": world, "timeout": timedelta(seconds=120)}
    if backend == "nccl":
        kw["device_id"] = device
    dist.init_process_group(**kw)


def worker(role: str, backend: str, port1: int, port2: int, world: int, mib: int, out: str) -> None:
    """One process: role ``survivor`` (rank 0), ``victim`` (rank 1, killed) or ``joiner``."""
    import torch
    import torch.distributed as dist

    from elasticd import teardown
    from elasticd.worker.live import broadcast_state

    teardown.keep_groups_on_destroy()
    gpu = 1 if role != "survivor" and backend == "nccl" else 0
    device = torch.device("cuda", gpu) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    res: dict[str, Any] = {"role": role}
    numel = mib * 2**20 // 4
    if role in ("survivor", "victim"):
        _group(backend, port1, 0 if role == "survivor" else 1, world, device)
        buf = torch.ones(numel, device=device)
        for _ in range(3):
            dist.all_reduce(buf)
        if backend == "nccl":
            torch.cuda.synchronize()
        if role == "victim":
            Path(out + ".victim").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        victim_file = Path(out + ".victim")
        killed_at: list[float] = []

        def watch() -> None:
            # elasticd's watcher aborts once the agent orders a new round; here: once the
            # victim is gone (world 2), or after 1 s (world 1: abort a healthy group).
            deadline = time.time() + 60
            while time.time() < deadline:
                if world == 1 and time.time() - started > 1.0:
                    break
                if victim_file.exists() and not Path(f"/proc/{victim_file.read_text()}").exists():
                    break
                time.sleep(0.01)
            killed_at.append(time.time())
            dist.group.WORLD.abort()

        started = time.time()
        threading.Thread(target=watch, daemon=True).start()
        t_err = None
        try:
            for _ in range(100000):
                dist.all_reduce(buf)
                if backend == "nccl":
                    torch.cuda.synchronize()
                if killed_at and world == 1:
                    break
        except Exception as exc:  # noqa: BLE001 - the abort's error is the point
            t_err = time.time()
            res["error"] = str(exc)[:200]
        # gloo sees the dead peer's closed socket by itself; NCCL needs the abort.
        res["failed_before_abort"] = bool(t_err and not killed_at)
        if killed_at:
            res["abort_to_error_s"] = round(t_err - killed_at[0], 3) if t_err else None
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            res["destroy_error"] = repr(exc)[:200]
        t0 = time.time()
        joiner = world == 2  # one GPU: no second device for a joiner (NCCL: one rank per GPU)
        _group(backend, port2, 0, 2 if joiner else 1, device)
        res["new_group_s"] = round(time.time() - t0, 3)
        model = {"w": torch.arange(numel, dtype=torch.float32, device=device) % 1000}
        t1 = time.time()
        if joiner:
            broadcast_state({"model": model}, 0, device)
        if backend == "nccl":
            torch.cuda.synchronize()
        res["state_sent_s"] = round(time.time() - t1, 3)
        check = torch.ones(1, device=device)
        dist.all_reduce(check)
        res["allreduce_after"] = float(check.item())
    else:  # joiner
        _group(backend, port2, 1, 2, device)
        t1 = time.time()
        got = broadcast_state(None, 0, device)
        res["state_received_s"] = round(time.time() - t1, 3)
        w = got["model"]["w"].to(device)
        expect = torch.arange(w.numel(), dtype=torch.float32, device=device) % 1000
        res["state_equal"] = bool(torch.equal(w, expect))
        res["gib"] = round(w.numel() * 4 / 2**30, 3)
        check = torch.ones(1, device=device)
        dist.all_reduce(check)
        res["allreduce_after"] = float(check.item())
    Path(f"{out}.{role}.json").write_text(json.dumps(res))
    os._exit(0)


def probe(backend: str, ranks: int, mib: int, timeout_s: float) -> dict[str, Any]:
    """Run the probe in subprocesses (all killed on every path); the merged results."""
    import tempfile

    out = os.path.join(tempfile.mkdtemp(prefix="elasticd-live-probe-"), "r")
    p1, p2 = _free_port(), _free_port()
    roles = ["survivor", "victim", "joiner"] if ranks == 2 else ["survivor"]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", role, "--backend", backend,
                               "--port1", str(p1), "--port2", str(p2), "--world", str(ranks),
                               "--mib", str(mib), "--out", out], env=env, start_new_session=True)
             for role in roles]
    t0 = time.time()
    try:
        for p in procs:
            p.wait(timeout=max(1.0, timeout_s - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    res: dict[str, Any] = {"backend": backend, "ranks": ranks, "mib": mib, "wall_s": round(time.time() - t0, 1)}
    for role in roles[::2]:
        f = Path(f"{out}.{role}.json")
        res[role] = json.loads(f.read_text()) if f.exists() else {"note": "no result (timed out or crashed)"}
    s, j = res["survivor"], res.get("joiner", {})
    if ranks == 2:
        res["ok"] = bool(j.get("state_equal") and s.get("allreduce_after") == 2.0 and "error" in s)
    else:
        res["ok"] = bool(s.get("allreduce_after") == 1.0 and "new_group_s" in s)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--ranks", type=int, default=None, help="1 or 2 (default: 2 if 2 GPUs, else 1)")
    p.add_argument("--mib", type=int, default=256, help="model size for the transfer, MiB")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--port1", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port2", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.backend, a.port1, a.port2, a.world, a.mib, a.out)
        return 0
    ranks = a.ranks
    if ranks is None:
        import torch

        ranks = 2 if a.backend == "gloo" or torch.cuda.device_count() >= 2 else 1
    res = probe(a.backend, ranks, a.mib, a.timeout_s)
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
