"""Live re-formation's state transfer against a raw socket copy of the same bytes.

Two processes on 127.0.0.1. (a) ``elasticd.worker.live.broadcast_state`` sends a model of
``--gib`` GiB of float32 parameters (in layers of ``--layer-mib`` MiB) from rank 0 to
rank 1 over a gloo group: the structure pickled once, the tensors as one flat buffer per
dtype. (b) The same number of bytes through a plain TCP socket (``sendall`` of one buffer,
``recv_into`` a preallocated one). Prints both times and the ratio (b)/(a): the share of
the raw loopback bandwidth the transfer reaches (issue 14's goal: ≥ 70 %).

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/live_transfer.py --gib 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(gib: float, layer_mib: int) -> dict[str, torch.Tensor]:
    per = layer_mib * 2**20 // 4
    n = max(1, int(gib * 2**30 // (per * 4)))
    return {f"layer{i}.weight": torch.full((per,), float(i)) for i in range(n)}


def _gloo(rank: int, port: int, gib: float, layer_mib: int, out: str) -> None:
    from elasticd.worker.live import broadcast_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    sd = {"model": _model(gib, layer_mib)} if rank == 0 else None
    dist.barrier()
    t0 = time.perf_counter()
    got = broadcast_state(sd, 0, torch.device("cpu"))
    dist.barrier()
    took = time.perf_counter() - t0
    if rank == 1:
        ok = all(float(v[0]) == float(k.split(".")[0][5:]) for k, v in got["model"].items())
        nbytes = sum(v.numel() * 4 for v in got["model"].values())
        Path(out).write_text(json.dumps({"seconds": took, "bytes": nbytes, "ok": ok}))
    dist.destroy_process_group()


def _raw(nbytes: int) -> float:
    """Seconds to move ``nbytes`` through a loopback TCP socket (a child process receives)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # receiver
        c = socket.create_connection(("127.0.0.1", port))
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            got += c.recv_into(view[got:], min(nbytes - got, 16 * 2**20))
        c.sendall(b"k")
        os._exit(0)
    conn, _ = srv.accept()
    data = bytearray(nbytes)
    t0 = time.perf_counter()
    conn.sendall(data)
    conn.recv(1)
    took = time.perf_counter() - t0
    os.waitpid(pid, 0)
    conn.close()
    srv.close()
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="model size, GiB of float32 parameters")
    p.add_argument("--layer-mib", type=int, default=64, help="size of one parameter tensor, MiB")
    args = p.parse_args(argv)
    out = Path(f"/tmp/elasticd-live-transfer-{os.getpid()}.json")
    mp.spawn(_gloo, args=(_free_port(), args.gib, args.layer_mib, str(out)), nprocs=2)
    gloo = json.loads(out.read_text())
    out.unlink()
    raw = _raw(gloo["bytes"])
    gib = gloo["bytes"] / 2**30
    print(json.dumps({"gib": round(gib, 3), "broadcast_state_s": round(gloo["seconds"], 3),
                      "raw_socket_s": round(raw, 3),
                      "broadcast_gib_per_s": round(gib / gloo["seconds"], 2),
                      "raw_gib_per_s": round(gib / raw, 2),
                      "ratio": round(raw / gloo["seconds"], 3), "ok": gloo["ok"]}))
    return 0 if gloo["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
