"""What elasticd's worker API adds to each training step, next to a plain DistributedSampler loop.

Two gloo ranks on 127.0.0.1 (started here with ``torch.multiprocessing``) train one small
DDP model in two ways, in short interleaved blocks of ``--block-steps`` steps (A B, B A,
A B, ... over ``--rounds`` rounds), so the load of a shared machine, which changes within
seconds, hits both alike:

- **A, plain:** ``DistributedSampler`` + ``DataLoader(batch_size=share)``, forward,
  backward, ``optimizer.step()``;
- **B, elasticd:** ``ElasticSampler`` + ``ElasticBatchSampler(plan)``,
  ``accumulation_contexts`` and ``plan.loss_scale``, ``sampler.step()``,
  ``worker.report_progress`` and ``worker.should_stop`` (one one-integer all-reduce),
  as docs/worker-api.md writes the loop;
- with ``--attribute``, also B without ``should_stop`` (what the data path and progress
  reports cost alone).

Each step also sleeps ``--device-ms`` (a stand-in for time on an accelerator, during which
the CPU is idle), so a step takes about 20 ms on an idle machine. The parent process runs
a real ``elasticd.control.ControlChannel`` and hands the workers its
``ELASTICD_CONTROL_DIR``/``ELASTICD_CONTROL_SOCKET``, so progress reports go over the real
Unix socket and ``should_stop`` stats the real drain file.

Reported (rank 0's clock): median and 10th-percentile step time and median CPU time per
step (the rank's process, gloo's threads included) of each loop; the ratio of the medians
B / A (goal: <= 1.01) and the median and quartiles of the per-round ratios; the cost per
call of ``should_stop()`` next to a bare one-int32 ``all_reduce`` (measured in alternating
chunks), of ``stop_requested_locally()``, and of ``report_progress()`` rate-limited (the
usual case) and forced (one JSON line on the socket); the load average before and after.
Finally the parent asks for a drain while both ranks poll ``should_stop`` and checks that
they stop at the same call and leave ``stopped-<rank>`` markers, and that the agent's
progress board saw both ranks; the exit code is 1 if a check fails.

    .venv/bin/python benchmarks/worker_overhead.py            # about 60-80 s, markdown
    .venv/bin/python benchmarks/worker_overhead.py --json
    .venv/bin/python benchmarks/worker_overhead.py --attribute --rounds 30
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
RESULT_TIMEOUT_S = 300.0  # a run that has not reported by then is stuck: fail, do not hang


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _per_call_us(fn: Any, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _worker(rank: int, env: dict[str, str], args: argparse.Namespace, results: Any,
            drain_asked: Any) -> None:
    """One rank: measure, report to the parent, then take part in the drain check."""
    # The worker API reads torchrun's contract from the environment, as under a launcher.
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    sys.path.insert(0, str(ROOT))

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from elasticd import worker

    torch.set_num_threads(1)  # two ranks on a small machine: no oversubscription
    ctx = worker.init(backend="gloo")
    assert ctx.under_agent and ctx.world_size == WORLD_SIZE, ctx

    gen = torch.Generator().manual_seed(0)
    n, width, classes = args.dataset_size, args.width, 10
    dataset = TensorDataset(torch.randn(n, width, generator=gen),
                            torch.randint(classes, (n,), generator=gen))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
                                torch.nn.Linear(2 * width, 2 * width), torch.nn.ReLU(),
                                torch.nn.Linear(2 * width, classes))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    device_s = args.device_ms / 1000.0
    share = args.global_batch // WORLD_SIZE

    class PlainLoop:
        """A: the DistributedSampler loop of PyTorch's DDP tutorial."""

        def __init__(self) -> None:
            self.sampler: DistributedSampler[int] = DistributedSampler(
                dataset, shuffle=True, seed=0, drop_last=True)
            self.loader = DataLoader(dataset, batch_size=share, sampler=self.sampler, drop_last=True)
            self.epoch = 0
            self.it = iter(self.loader)

        def step(self) -> None:
            try:
                x, y = next(self.it)
            except StopIteration:
                self.epoch += 1
                self.sampler.set_epoch(self.epoch)
                self.it = iter(self.loader)
                x, y = next(self.it)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            time.sleep(device_s)
            optimizer.step()
            optimizer.zero_grad()

    class ElasticLoop:
        """B: the same step written with the worker API (docs/worker-api.md)."""

        def __init__(self, agree: bool = True) -> None:
            self.agree = agree
            self.sampler = worker.ElasticSampler(dataset, global_batch_size=args.global_batch, seed=0)
            self.plan = worker.plan_global_batch(args.global_batch, ctx.world_size, share,
                                                 allow_uneven=True)
            self.loader = DataLoader(dataset,
                                     batch_sampler=worker.ElasticBatchSampler(self.sampler, self.plan))
            self.it = iter(self.loader)
            self.n = 0

        def step(self) -> None:
            if self.sampler.steps_remaining == 0:
                self.sampler.set_epoch(self.sampler.epoch + 1)
                self.it = iter(self.loader)
            for sync in worker.accumulation_contexts(ddp, self.plan):
                x, y = next(self.it)
                with sync:
                    loss = F.cross_entropy(ddp(x), y)
                    (loss * self.plan.loss_scale(len(x))).backward()
            time.sleep(device_s)
            optimizer.step()
            optimizer.zero_grad()
            self.sampler.step()
            worker.report_progress(self.n, epoch=self.sampler.epoch,
                                   samples=(self.n + 1) * args.global_batch)
            if self.agree and worker.should_stop(self.n, every=args.stop_every):
                raise RuntimeError("should_stop() returned True before any drain was asked")
            self.n += 1

    loops: dict[str, Any] = {"plain": PlainLoop(), "elasticd": ElasticLoop()}
    if args.attribute:
        loops["no-stop"] = ElasticLoop(agree=False)
    names = list(loops)

    def block(name: str, steps: int) -> dict[str, list[float]]:
        loop, wall, cpu = loops[name], [], []
        dist.barrier()
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            loop.step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)  # all threads of this rank, gloo's included
        return {"wall": wall, "cpu": cpu}

    for name in names:
        block(name, args.warmup_steps)
    rounds: list[dict[str, dict[str, list[float]]]] = []
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: drift hits all alike
        rounds.append({name: block(name, args.block_steps) for name in order})

    # Raw costs, every rank calling in lockstep (should_stop is a collective).
    calls = args.calls
    flag = torch.zeros(1, dtype=torch.int32)
    bare, agreed, chunk = [], [], max(calls // 10, 1)
    for _ in range(10):  # alternate chunks: the machine's load changes under both alike
        dist.barrier()
        bare.append(_per_call_us(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX), chunk))
        dist.barrier()
        agreed.append(_per_call_us(worker.should_stop, chunk))
    bare_us, should_stop_us = statistics.median(bare), statistics.median(agreed)
    local_us = _per_call_us(worker.stop_requested_locally, calls)
    limited_us = _per_call_us(lambda: worker.report_progress(1, epoch=0, samples=1), calls * 10)
    forced_us = _per_call_us(lambda: worker.report_progress(1, epoch=0, samples=1, force=True), calls)

    if rank == 0:
        results.put({"kind": "measured", "rounds": rounds, "bare_allreduce_us": bare_us,
                     "should_stop_us": should_stop_us, "stop_requested_locally_us": local_us,
                     "report_progress_limited_us": limited_us,
                     "report_progress_forced_us": forced_us,
                     "elasticd_steps": loops["elasticd"].n})

    # Drain check: poll should_stop while the parent writes the drain file at some moment.
    dist.barrier()
    drain_asked.set()
    stopped_at = -1
    for i in range(args.drain_polls):
        if worker.should_stop(i):
            stopped_at = i
            break
        time.sleep(0.002)
    results.put({"kind": "stopped", "rank": rank, "call": stopped_at})
    worker.shutdown()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def _summary(measured: dict[str, Any]) -> dict[str, Any]:
    rounds = measured["rounds"]
    names = list(rounds[0])
    wall = {name: [t for rnd in rounds for t in rnd[name]["wall"]] for name in names}
    cpu = {name: [t for rnd in rounds for t in rnd[name]["cpu"]] for name in names}
    median_ms = {name: statistics.median(times) * 1e3 for name, times in wall.items()}
    out: dict[str, Any] = {
        "step_ms": {name: round(ms, 3) for name, ms in median_ms.items()},
        "step_p10_ms": {name: round(_quantile(t, 0.1) * 1e3, 3) for name, t in wall.items()},
        "cpu_ms": {name: round(statistics.median(t) * 1e3, 3) for name, t in cpu.items()},
        "steps_per_variant": len(wall["plain"]),
    }
    for name in names[1:]:
        per_round = [statistics.median(rnd[name]["wall"]) / statistics.median(rnd["plain"]["wall"])
                     for rnd in rounds]
        out[f"ratio_{name}"] = round(median_ms[name] / median_ms["plain"], 4)
        out[f"round_ratios_{name}"] = [round(x, 4) for x in per_round]
    out.update({
        "bare_allreduce_us": round(measured["bare_allreduce_us"], 1),
        "should_stop_us": round(measured["should_stop_us"], 1),
        "stop_requested_locally_us": round(measured["stop_requested_locally_us"], 2),
        "report_progress_limited_us": round(measured["report_progress_limited_us"], 2),
        "report_progress_forced_us": round(measured["report_progress_forced_us"], 1),
    })
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the control channel and two ranks, collect and check their results."""
    import torch
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT))
    from elasticd.control import ControlChannel

    channel = ControlChannel().start()
    started = time.monotonic()
    load_before = round(os.getloadavg()[0], 2)
    procs = None
    try:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
               "ELASTICD_JOB": "bench", "ELASTICD_ROUND": "0", "ELASTICD_NODE": "bench-node",
               "OMP_NUM_THREADS": "1", **channel.env()}
        spawn = mp.get_context("spawn")
        results, drain_asked = spawn.Queue(), spawn.Event()
        procs = mp.spawn(_worker, args=(env, args, results, drain_asked), nprocs=WORLD_SIZE,
                         join=False)
        measured = _get(results, procs)
        if not drain_asked.wait(RESULT_TIMEOUT_S):
            raise RuntimeError("workers never reached the drain check")
        time.sleep(0.05)  # let both ranks poll a few times before the drain appears
        channel.request_drain("benchmark finished")
        stops = [_get(results, procs) for _ in range(WORLD_SIZE)]
        while not procs.join(timeout=RESULT_TIMEOUT_S):
            pass
        procs = None
        board = channel.progress.snapshot()
        markers = channel.stopped_markers()
    finally:
        if procs is not None:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()  # only the ranks this run started
        channel.close()
    calls = {s["rank"]: s["call"] for s in stops}
    checks = {
        "drain_agreed": len(set(calls.values())) == 1 and -1 not in calls.values(),
        "drain_call": sorted(calls.items()),
        "stopped_markers": sorted(markers),
        "progress_ranks": sorted(board),
        "progress_max_step": max((p.step for p in board.values()), default=-1),
    }
    ok = (checks["drain_agreed"] and checks["stopped_markers"] == list(range(WORLD_SIZE))
          and checks["progress_ranks"] == list(range(WORLD_SIZE)))
    return {
        **_summary(measured),
        "checks": checks,
        "checks_ok": ok,
        "config": {k: getattr(args, k) for k in ("device_ms", "width", "global_batch", "dataset_size",
                                                 "rounds", "block_steps", "warmup_steps", "calls",
                                                 "attribute")},
        "wall_s": round(time.monotonic() - started, 1),
        "load_before": load_before,
        "load_after": round(os.getloadavg()[0], 2),
        "machine": f"{os.cpu_count()} CPUs, {_cpu_model()}",
        "versions": f"Python {platform.python_version()}, torch {torch.__version__}",
        "date": dt.date.today().isoformat(),
    }


def _get(results: Any, procs: Any) -> dict[str, Any]:
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return dict(results.get(timeout=1.0))
        except queue.Empty:
            procs.join(timeout=0)  # raises at once if a rank died
    raise RuntimeError(f"no result from the workers within {RESULT_TIMEOUT_S:.0f} s")


_LABELS = {"plain": "A: DistributedSampler", "elasticd": "B: elasticd worker API",
           "no-stop": "B without `should_stop()`"}


def _markdown(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"{r['machine']}; {r['versions']}; {r['date']}; {r['wall_s']} s wall; "
        f"load average {r['load_before']} before, {r['load_after']} after",
        f"step: {c['device_ms']} ms sleep + MLP {c['width']}-{2 * c['width']}-{2 * c['width']}-10, "
        f"global batch {c['global_batch']} over 2 gloo ranks; {c['rounds']} rounds of "
        f"{c['block_steps']}-step blocks ({r['steps_per_variant']} steps per loop)",
        "",
        "| loop | median step (ms) | p10 step (ms) | CPU per step (ms) | ratio of medians to A "
        "| per-round ratio: median (p25-p75) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, ms in r["step_ms"].items():
        if name == "plain":
            lines.append(f"| {_LABELS[name]} | {ms:.2f} | {r['step_p10_ms'][name]:.2f} | "
                         f"{r['cpu_ms'][name]:.2f} | 1 | |")
            continue
        rr = r[f"round_ratios_{name}"]
        lines.append(f"| {_LABELS[name]} | {ms:.2f} | {r['step_p10_ms'][name]:.2f} | "
                     f"{r['cpu_ms'][name]:.2f} | {r[f'ratio_{name}']:.4f} | {statistics.median(rr):.4f} "
                     f"({_quantile(rr, 0.25):.4f}-{_quantile(rr, 0.75):.4f}) |")
    lines += [
        "",
        "| call | µs per call |",
        "|---|---:|",
        f"| `should_stop()` (2 ranks, gloo) | {r['should_stop_us']:.1f} |",
        f"| bare `all_reduce` of one int32 | {r['bare_allreduce_us']:.1f} |",
        f"| `stop_requested_locally()` | {r['stop_requested_locally_us']:.2f} |",
        f"| `report_progress()`, rate-limited | {r['report_progress_limited_us']:.2f} |",
        f"| `report_progress(force=True)` | {r['report_progress_forced_us']:.1f} |",
        "",
        f"checks: {'ok' if r['checks_ok'] else 'FAILED'} {json.dumps(r['checks'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device-ms", type=float, default=15.0,
                        help="sleep per step standing in for accelerator time (default 15)")
    parser.add_argument("--width", type=int, default=256, help="MLP input width (hidden: 2x)")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--dataset-size", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=50, help="rounds of one block per loop")
    parser.add_argument("--attribute", action="store_true",
                        help="add a third loop: B without should_stop() (sampler + progress only)")
    parser.add_argument("--block-steps", type=int, default=20,
                        help="steps per block; short blocks follow the machine's load closely")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000, help="calls per raw-cost measurement")
    parser.add_argument("--drain-polls", type=int, default=5000, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--stop-every", type=int, default=1,
                        help="should_stop(step, every=N) in loop B (default 1: every step)")
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result) if args.json else _markdown(result), flush=True)
    return 0 if result["checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
