"""Steady-state overhead of live re-formation: the same training loop with and without
``LiveState``, interleaved in one run, as a per-step time ratio.

Two gloo ranks on 127.0.0.1 (``torch.multiprocessing``), under a real
``elasticd.control.ControlChannel`` with live re-formation on (``ELASTICD_LIVE=1``), so
``LiveState`` is enabled exactly as under an agent (its marker, its watcher thread). One
process pair trains one DDP model in short blocks of ``--block-steps`` steps, three arms
per round in rotating order (ABC, BCA, CAB, CBA, BAC, ACB) over ``--rounds`` rounds, so the
load of a shared machine hits all alike:

- **A, without:** forward, backward, ``optimizer.step()``, ``worker.should_stop(step)``
  (today's loop);
- **B, with:** the same step inside ``live.guard()``, then ``live.step_done(step)``
  (which calls ``should_stop``), as docs/worker-api.md writes the loop;
- **C, control:** A again. C/A is what the machine's noise alone makes of "no change":
  read B/A against it.

Models: ``example`` is examples/train.py's (16-64-1, float64, 32 samples per rank: a step
of well under a millisecond of compute, so any per-step cost shows: the worst case);
``mlp`` is 3 layers of ``--width`` (float32). The watcher thread (one ``stat`` of the
order file every 50 ms) runs through A and B alike (it starts with ``LiveState`` and has
no off switch), so its cost is reported apart: its CPU seconds per second of wall time,
read from /proc.

Reported (rank 0's clock): median step time of A and B, the ratio of the medians B/A,
the median and quartiles of the per-round ratios (goal: ≤ 1.01), the same for the A/A
control, the watcher's CPU share.

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/live_overhead.py --model example
    PYTHONPATH=$PWD .venv/bin/python benchmarks/live_overhead.py --model mlp --width 512
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _thread_cpu_s(name_prefix: str) -> float:
    """CPU seconds (user + system) of this process's Python threads whose name starts so."""
    import threading

    total = 0
    for th in threading.enumerate():
        if not th.name.startswith(name_prefix) or th.native_id is None:
            continue
        try:
            stat = Path(f"/proc/self/task/{th.native_id}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def _worker(rank: int, env: dict[str, str], args: argparse.Namespace, out: str) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from elasticd import worker
    from elasticd.teardown import end_process

    torch.set_num_threads(1)  # two ranks on a small machine: no oversubscription
    ctx = worker.init(backend="gloo")
    torch.manual_seed(0)
    nn = torch.nn
    if args.model == "example":
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).double()
        x, y = torch.randn(args.batch, 16, dtype=torch.float64), torch.randn(args.batch, 1, dtype=torch.float64)
    else:
        w = args.width
        model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 1))
        x, y = torch.randn(args.batch, w), torch.randn(args.batch, 1)
    ddp = DDP(model)
    optim = torch.optim.SGD(model.parameters(), lr=1e-4)
    live = worker.LiveState({"model": model, "optim": optim}, timeout_s=30)
    assert live.enabled, "live re-formation is not on: the benchmark would measure nothing"
    step = live.resume(lambda: -1) + 1

    def train() -> None:
        optim.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        optim.step()

    def plain(s: int) -> None:
        train()
        if worker.should_stop(s):
            raise RuntimeError("unexpected stop")

    def with_live(s: int) -> None:
        with live.guard():
            train()
            if live.step_done(s):
                raise RuntimeError("unexpected stop")

    times: dict[str, list[float]] = {"A": [], "B": [], "C": []}
    per_round: list[tuple[float, float, float]] = []
    orders = ("ABC", "BCA", "CAB", "CBA", "BAC", "ACB")  # every arm in every position
    for _ in range(args.warmup):
        plain(step)
        step += 1
    wall0, cpu0 = time.monotonic(), _thread_cpu_s("elasticd-live")
    for r in range(args.rounds):
        medians: dict[str, float] = {}
        for name in orders[r % len(orders)]:
            fn = with_live if name == "B" else plain
            block = []
            for _ in range(args.block_steps):
                t0 = time.perf_counter()
                fn(step)
                block.append(time.perf_counter() - t0)
                step += 1
            times[name] += block
            medians[name] = statistics.median(block)
        per_round.append((medians["A"], medians["B"], medians["C"]))
    watcher = (_thread_cpu_s("elasticd-live") - cpu0) / (time.monotonic() - wall0)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "per_round": per_round, "watcher": watcher,
                                         "world": ctx.world_size, "steps": step}))
    end_process(0)  # torch's gloo destructor race at exit (elasticd.teardown)


def _quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return [round(v, 4) for v in q]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("example", "mlp"), default="example")
    p.add_argument("--width", type=int, default=512, help="hidden width of --model mlp")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--block-steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch.multiprocessing as mp

    from elasticd.control import ControlChannel
    from elasticd.control.api import ENV_LIVE

    out = Path(f"/tmp/elasticd-live-overhead-{os.getpid()}.json")
    load_before = round(os.getloadavg()[0], 2)
    channel = ControlChannel().start()
    try:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
               "ELASTICD_JOB": "bench", "ELASTICD_ROUND": "0", "ELASTICD_NODE": "bench-node",
               "OMP_NUM_THREADS": "1", ENV_LIVE: "1", **channel.env()}
        mp.spawn(_worker, args=(env, args, str(out)), nprocs=WORLD_SIZE)
    finally:
        channel.close()
    res: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    a, b = statistics.median(res["times"]["A"]), statistics.median(res["times"]["B"])
    c = statistics.median(res["times"]["C"])
    ratios = [rb / ra for ra, rb, _ in res["per_round"]]
    noise = [rc / ra for ra, _, rc in res["per_round"]]
    report = {"model": args.model if args.model == "example" else f"mlp{args.width}",
              "batch_per_rank": args.batch, "rounds": args.rounds, "block_steps": args.block_steps,
              "step_ms_without": round(a * 1e3, 4), "step_ms_with": round(b * 1e3, 4),
              "ratio_of_medians": round(b / a, 4), "per_round_ratio_median": round(statistics.median(ratios), 4),
              "per_round_ratio_quartiles": _quartiles(ratios),
              "a_a_ratio_of_medians": round(c / a, 4), "a_a_per_round_quartiles": _quartiles(noise),
              "watcher_cpu_share": round(res["watcher"], 5),
              "load_before": load_before, "load_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(report))
    if not args.json:
        print(f"step {report['step_ms_without']} ms without LiveState, {report['step_ms_with']} ms with: "
              f"ratio {report['ratio_of_medians']} (per round: median {report['per_round_ratio_median']}, "
              f"quartiles {report['per_round_ratio_quartiles']}); A/A control "
              f"{report['a_a_ratio_of_medians']} (quartiles {report['a_a_per_round_quartiles']}); watcher thread "
              f"{100 * report['watcher_cpu_share']:.3f} % of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
