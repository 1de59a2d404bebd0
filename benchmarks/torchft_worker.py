"""The torchft side of benchmarks/recovery.py: one replica group of torchft 0.2.0's DDP loop.

Written after torchft's own ``train_ddp.py`` (one replica group per torchrun, a
``Manager`` talking to a shared lighthouse, torchft's ``DistributedDataParallel`` and
``Optimizer`` wrappers, a reconfigurable ``ProcessGroupGloo`` and the process-group
checkpoint transport for healing a joiner from a live peer), on the benchmarks' small
model (``examples/train.py``'s MLP, 16 → 64 → 1) with random data instead of CIFAR-10 so
the replica's start-up is torch's, not a dataset download's.

Run by torchrun, one process per replica group (``--nnodes 1 --nproc-per-node 1``): the
group's store is torchrun's, as torchft's README launches it. The lighthouse address comes
from ``TORCHFT_LIGHTHOUSE``. Each committed step appends one JSON line ``{"step", "world",
"time", "rank"}`` to ``--out`` with ``world`` = the replica groups in that step's quorum,
in the format of ``benchmarks/bench_worker.py``, so ``recovery.py`` times both alike.
torchft keeps no checkpoint here: a killed replica's state lives on in its peers, and a
joiner heals from one of them (its first committed step continues the survivors' count).

Not a test of elasticd: the benchmarks compare launchers, and this is torchft's.
"""

from __future__ import annotations

import os
import time


def _process_start_wall() -> float:
    """Wall-clock time at which this process was exec'd (10 ms resolution, from /proc)."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime") as fh:
            uptime_s = float(fh.read().split()[0])
        return time.time() - (uptime_s - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


SPAWNED_AT = _process_start_wall()
IMPORT_STARTED_AT = time.time()

import argparse  # noqa: E402 - after the start-time probe on purpose
import json  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # noqa: E402
from torchft.checkpointing.pg_transport import PGTransport  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="append per-step JSON lines to this file")
    p.add_argument("--replica", type=int, required=True, help="this replica group's index")
    p.add_argument("--step-s", type=float, default=0.02,
                   help="pad each step to this many seconds with a sleep (0: no padding)")
    p.add_argument("--min-replicas", type=int, default=2, help="Manager's min_replica_size")
    p.add_argument("--hidden", type=int, default=64, help="width of the MLP")
    p.add_argument("--batch", type=int, default=32, help="samples per replica per step")
    return p.parse_args(argv)


def write_line(fd: int, record: dict) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())  # one write(2): replicas' lines stay whole


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    imported_at = time.time()
    out = os.open(args.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    torch.manual_seed(0)  # same start weights everywhere; torchft's init_sync checks step 0 too
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 1))
    opt_inner = torch.optim.SGD(model.parameters(), lr=0.05)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        opt_inner.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt_inner.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))  # train_ddp.py's CPU choice
    manager = Manager(pg=pg, min_replica_size=args.min_replicas, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"bench_{args.replica}",
                      hostname="127.0.0.1", timeout=timedelta(seconds=30),
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10),
                                                       device=torch.device("cpu")))
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, opt_inner)
    gen = torch.Generator().manual_seed(1000 + args.replica)
    x, y = torch.randn(args.batch, 16, generator=gen), torch.randn(args.batch, 1, generator=gen)
    write_line(out, {"event": "start", "rank": args.replica, "world": 0, "pid": os.getpid(),
                     "spawned": SPAWNED_AT, "imports_from": IMPORT_STARTED_AT,
                     "imported": imported_at, "ready": time.time(), "resume": manager.current_step()})
    while True:
        t0 = time.perf_counter()
        opt.zero_grad()  # starts the quorum (asynchronously, as in train_ddp.py)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # gradients all-reduced across the quorum's replica groups
        before = manager.current_step()
        opt.step()  # commits only if every participant's all-reduce succeeded
        left = args.step_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        if manager.current_step() > before:  # committed: step `before` is trained
            write_line(out, {"step": before, "world": manager.num_participants(),
                             "time": time.time(), "rank": args.replica})


if __name__ == "__main__":
    sys.exit(main())
