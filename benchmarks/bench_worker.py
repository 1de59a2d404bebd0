"""The benchmarks' training worker: a DDP-like loop that runs unchanged under elasticd and torchrun.

Each step does a forward/backward pass of a tiny MLP on random data, all-reduces the
flattened gradients (gloo), takes an SGD step, optionally sleeps to pad the step to
``--step-s`` (a stand-in for time spent on an accelerator, leaving the CPU to the agents),
and appends one JSON line ``{"step", "world", "time", "rank"}`` to ``--out``. Rank 0 writes
a tiny checkpoint (``{"step": N}``, write + rename) after every step, and every start
resumes from it, so "steps lost" is measurable for any launcher.

Stopping on a drain:

- under an elasticd agent, ``elasticd.worker.should_stop(step)``: every rank agrees on the
  step, rank 0 checkpoints it, all exit 0 (zero steps lost by construction);
- under torchrun the same call (the same one-integer all-reduce per step, so both
  launchers pay the same per-step cost) reports a SIGTERM, but only the ranks that got
  the SIGTERM leave: torchrun has no drain protocol, so a peer that stopped for another
  node's drain would exit 0 and its launcher would take that for the end of the job.
  The survivors find out through their next collective failing, as they would with any
  torchrun script.

Lines written besides the steps (all with ``"event"``): ``start`` (when the process was
exec'd, from /proc, and when the process group and checkpoint were ready).
"""

from __future__ import annotations

import os
import time


def _process_start_wall() -> float:
    """Wall-clock time at which this process was exec'd (10 ms resolution, from /proc)."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        with open("/proc/uptime") as fh:
            uptime_s = float(fh.read().split()[0])
        return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


SPAWNED_AT = _process_start_wall()
IMPORT_STARTED_AT = time.time()

import argparse  # noqa: E402 - after the start-time probe on purpose
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from elasticd import worker  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="append per-step JSON lines to this file")
    p.add_argument("--ckpt", required=True, help="rank 0's checkpoint file ({'step': N})")
    p.add_argument("--steps", type=int, default=10**9, help="stop after this step")
    p.add_argument("--step-s", type=float, default=0.02,
                   help="pad each step to this many seconds with a sleep (0: no padding)")
    p.add_argument("--hidden", type=int, default=64, help="width of the MLP")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def load_step(path: str) -> int:
    """The last checkpointed step, or -1 if there is none (or it is torn)."""
    try:
        with open(path) as fh:
            return int(json.load(fh)["step"])
    except (OSError, ValueError, KeyError):
        return -1


def save_step(path: str, step: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"step": step}, fh)
    os.replace(tmp, path)


class LineWriter:
    """Appends whole JSON lines with one write(2) each (O_APPEND keeps ranks' lines whole)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        os.write(self.fd, (json.dumps(record) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    imported_at = time.time()
    ctx = worker.init("gloo")
    pg_ready_at = time.time()
    out = LineWriter(args.out)
    rank, world = ctx.rank, ctx.world_size
    resume = load_step(args.ckpt) + 1
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 1))
    params = list(model.parameters())
    if dist.is_initialized():  # same start weights everywhere, as DDP's constructor does
        for p in params:
            dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(params, lr=0.01)  # the first optimizer imports torch._dynamo (~1.7 s)
    built_at = time.time()
    x, y = torch.randn(args.batch, args.hidden), torch.randn(args.batch, 1)
    out.write({"event": "start", "rank": rank, "world": world, "pid": os.getpid(),
               "spawned": SPAWNED_AT, "imports_from": IMPORT_STARTED_AT, "imported": imported_at,
               "pg": pg_ready_at, "built": built_at, "ready": time.time(), "resume": resume, "round": ctx.round,
               "restart": ctx.restart_count})
    step = resume
    while step <= args.steps:
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        opt.step()
        left = args.step_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        out.write({"step": step, "world": world, "time": time.time(), "rank": rank})
        if rank == 0:
            save_step(args.ckpt, step)
        worker.report_progress(step)
        if worker.should_stop(step) and (ctx.under_agent or worker.stop_requested_locally()):
            out.write({"event": "stopped", "step": step, "rank": rank, "time": time.time()})
            break
        step += 1
    # Destroy the process group before exiting: rank 0 hosts the workers' TCPStore, and
    # an interpreter exit with a live group can abort ("terminate called without an
    # active exception"), which the launcher sees as a failure.
    worker.shutdown()
    out.write({"event": "exited", "rank": rank, "time": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
