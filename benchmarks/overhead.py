"""Steady-state overhead: steps/s of the same script under elasticd and under torchrun.

Same script, same world (2 nodes × 1 worker by default, or ``--layout 1x2``: one node
with 2 workers), runs interleaved A B A B ... so that drifts of the shared machine hit
both launchers alike. Each run starts its nodes, waits until every node trains at the
full world size, lets ``--warmup`` seconds pass, then counts steps over ``--window``
seconds, from rank 0's step lines. It also samples CPU time (from /proc) of the
launchers, of the workers and of etcd over the window, to show where any difference goes.

torchrun runs with the c10d rendezvous and torch's defaults (its steady state does not
depend on the recovery tuning, except that a 1 s keep-alive costs it a little more).

Scripts: ``examples/train.py --step-sleep 0 --checkpoint-every 1000`` (if it runs; a few
ms per step, one output line per step, which elasticd tees through its agent) and
``benchmarks/bench_worker.py --step-s 0 --hidden 1024 --batch 512`` (~20 ms of compute
and a 4 MB all-reduce per step, no padding, so any CPU the launcher takes shows up).

Usage::

    .venv/bin/python benchmarks/overhead.py                 # ~8 min
    .venv/bin/python benchmarks/overhead.py --pairs 1 --window 10 --no-doc
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    BENCH_WORKER,
    TORCHRUN_ENV,
    TRAIN_SCRIPT,
    Cluster,
    StepSource,
    elasticd_argv,
    first_step_at,
    free_port,
    machine_info,
    machine_line,
    other_load,
    port_listening,
    replace_generated_block,
    sigterm_as_interrupt,
    stat_fields,
    summary,
    torchrun_argv,
    wait_until,
)

CLK = 100.0  # SC_CLK_TCK on Linux
BENCH_FLAGS = ["--hidden", "1024", "--batch", "512"]  # ~20 ms of compute, 4 MB all-reduced per step
TRAIN_FLAGS = ["--checkpoint-every", "1000"]


def cpu_s(pid: int) -> float:
    """utime + stime of one process, in seconds (0 if it is gone)."""
    f = stat_fields(pid)
    return (int(f[11]) + int(f[12])) / CLK if f else 0.0


def bench_args(src: StepSource) -> list[str]:
    args = src.args()
    if src.is_bench:
        args[args.index("--step-s") + 1] = "0"
        args += BENCH_FLAGS
    else:
        # A checkpoint every 10 steps (train.py's default) would be ~30 per second here;
        # elasticd commits each through its agent to etcd, so it would measure
        # checkpoint commits, not the steady state.
        args[args.index("--step-sleep") + 1] = "0"
        args += TRAIN_FLAGS
    return args


def one_run(system: str, script: str, layout: str, etcd: object, workdir: Path,
            args: argparse.Namespace) -> dict:
    """Start the job, wait for steady training, measure steps/s and CPU over the window."""
    nodes, nproc = (2, 1) if layout == "2x1" else (1, 2)
    world = nodes * nproc
    src = StepSource(script, workdir)
    script_args = bench_args(src)
    job = f"ovh-{int(time.time() * 1000) % 10**8}"
    port = free_port()
    out: dict = {"system": system, "script": script}
    with Cluster(workdir) as cluster:
        for i in range(nodes):
            logs = workdir / "logs" / f"n{i}"
            logs.mkdir(parents=True, exist_ok=True)
            if system == "elasticd":
                argv = elasticd_argv(etcd.endpoint, job, f"n{i}", str(nodes), nproc,  # type: ignore[attr-defined]
                                     script_args, logs)
                env = {"PYTHONUNBUFFERED": "1"}
            else:
                argv = torchrun_argv(port, job, str(nodes), nproc, script_args, None, logs)
                env = {**TORCHRUN_ENV, "PYTHONUNBUFFERED": "1"}
            cluster.start(f"n{i}", argv, env, on_line=src.on_line)
            if system != "elasticd" and i == 0:
                wait_until(lambda: port_listening(port), 60)
        ranks = src.ranks_per_step(world)
        if not wait_until(lambda: first_step_at(src.records(), world, 0, ranks), args.start_timeout):
            out["error"] = f"no step at world {world} within {args.start_timeout:.0f}s"
            return out
        time.sleep(args.warmup)
        cluster.refresh()
        launchers = [n.pid for n in cluster.nodes]
        workers = [p for n in cluster.nodes for p in n.tree() if p != n.pid]
        others = [etcd.proc.pid] if system == "elasticd" else []  # type: ignore[attr-defined]
        c0 = [sum(cpu_s(p) for p in group) for group in (launchers, workers, others)]
        t_a = time.time()
        time.sleep(args.window)
        t_b = time.time()
        c1 = [sum(cpu_s(p) for p in group) for group in (launchers, workers, others)]
    steps = sorted((r["time"], r["step"]) for r in src.records()
                   if "step" in r and "event" not in r and r.get("rank") == 0
                   and r.get("world") == world and t_a <= r["time"] <= t_b)
    if len(steps) < 2:
        out["error"] = "fewer than 2 steps in the window"
        return out
    (ta, sa), (tb, sb) = steps[0], steps[-1]
    out["steps_per_s"] = (sb - sa) / (tb - ta)
    span = t_b - t_a
    out["cpu_pct"] = {k: 100.0 * (c1[i] - c0[i]) / span
                      for i, k in enumerate(("launchers", "workers", "etcd"))}
    return out


def verdict(ratios: list[float], goal: float = 0.99) -> str:
    """met / missed only when every pair agrees; otherwise the noise is larger than the goal."""
    if min(ratios) >= goal:
        return "met"
    if max(ratios) < goal:
        return "**missed**"
    return f"not resolved (pairs {min(ratios):.2f}–{max(ratios):.2f})"


def report(results: list[dict], info: dict, argv: list[str], busy: list[str], layout: str,
           window: float) -> str:
    rows = ["| script | elasticd steps/s | torchrun steps/s | ratio elasticd/torchrun "
            "(per pair) | ratio of steps per worker CPU-second | launcher CPU %, elasticd / "
            "torchrun | etcd CPU % | goal ≥ 0.99 |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    for script in dict.fromkeys(r["script"] for r in results):
        a = [r for r in results if r["script"] == script and r["system"] == "elasticd" and "steps_per_s" in r]
        b = [r for r in results if r["script"] == script and r["system"] == "torchrun" and "steps_per_s" in r]
        if not a or not b:
            continue
        ratios = [x["steps_per_s"] / y["steps_per_s"] for x, y in zip(a, b, strict=False)]
        per_cpu = [(x["steps_per_s"] / x["cpu_pct"]["workers"]) / (y["steps_per_s"] / y["cpu_pct"]["workers"])
                   for x, y in zip(a, b, strict=False)]
        flags = ["--step-s", "0", *BENCH_FLAGS] if script == BENCH_WORKER else ["--step-sleep", "0", *TRAIN_FLAGS]
        name = f"`{script} {' '.join(flags)}`"
        rows.append(
            f"| {name} | {summary([x['steps_per_s'] for x in a])} | "
            f"{summary([y['steps_per_s'] for y in b])} | {summary(ratios, '{:.3f}')} | "
            f"{summary(per_cpu, '{:.3f}')} | "
            f"{summary([x['cpu_pct']['launchers'] for x in a])} / "
            f"{summary([y['cpu_pct']['launchers'] for y in b])} | "
            f"{summary([x['cpu_pct']['etcd'] for x in a])} | "
            f"{verdict(ratios)} |")
    shared = (f" The machine was shared while this ran (other busy processes at the start: "
              f"{len(busy)}), which is why the runs are interleaved.") if busy else ""
    world = "2 nodes × 1 worker" if layout == "2x1" else "1 node × 2 workers"
    return "\n".join([
        f"Measured {machine_line(info)}.{shared}",
        "",
        "```",
        f".venv/bin/python benchmarks/overhead.py {' '.join(argv)}".rstrip(),
        "```",
        "",
        f"{world}, gloo, 127.0.0.1; elasticd with one embedded etcd (`--node-ttl 2`), torchrun "
        "with `--rdzv-backend c10d` and torch's defaults. Runs interleaved elasticd, torchrun, "
        f"elasticd, ...; steps/s of rank 0 over a {window:.0f} s window after warm-up, "
        "median (min–max) over the runs; the ratio is taken per adjacent pair. CPU % is "
        "per window (100 % = one core), summed over the launcher processes (agents or "
        "torchrun), and for etcd the embedded server. Steps per worker CPU-second divides "
        "out how much CPU the workers got from a machine that others were using too.",
        "",
        *rows,
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="elasticd/torchrun pairs per script")
    p.add_argument("--window", type=float, default=20.0, help="measuring window, s")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of training before the window")
    p.add_argument("--layout", choices=["2x1", "1x2"], default="2x1", help="nodes x workers")
    p.add_argument("--script", action="append", default=None,
                   help=f"script(s) to run (default: {TRAIN_SCRIPT} if it runs, and {BENCH_WORKER})")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--no-doc", action="store_true")
    p.add_argument("--report-from", metavar="DIR", help="do not run: report an earlier --workdir")
    args = p.parse_args(argv)
    if args.report_from:
        saved = json.loads((Path(args.report_from) / "results.json").read_text())
        text = report(saved["results"], saved["machine"], saved.get("argv", []), saved.get("busy", []),
                      saved.get("layout", "2x1"), saved.get("window", args.window))
        if not args.no_doc:
            replace_generated_block("Steady-state overhead", "overhead", text)
        print(text)
        return 0
    from benchmarks.recovery import script_available
    from elasticd.etcd.embedded import EmbeddedEtcd

    scripts = args.script or ([TRAIN_SCRIPT] if script_available(TRAIN_SCRIPT) else []) + [BENCH_WORKER]
    root = Path(args.workdir or tempfile.mkdtemp(prefix="elasticd-overhead-"))
    root.mkdir(parents=True, exist_ok=True)
    info, busy = machine_info(), other_load()
    results: list[dict] = []
    etcd = EmbeddedEtcd(data_dir=str(root / "etcd"))
    with sigterm_as_interrupt():
        try:
            etcd.start()
            for script in scripts:
                for pair in range(args.pairs):
                    for system in ("elasticd", "torchrun"):
                        workdir = root / f"{Path(script).stem}-{system}-{pair}"
                        workdir.mkdir(parents=True)
                        r = one_run(system, script, args.layout, etcd, workdir, args)
                        results.append(r)
                        print(json.dumps(r), flush=True)
        finally:
            etcd.stop(remove_data=False)
    (root / "results.json").write_text(json.dumps(
        {"machine": info, "results": results, "argv": sys.argv[1:], "busy": busy,
         "layout": args.layout, "window": args.window}, indent=1))
    text = report(results, info, sys.argv[1:], busy, args.layout, args.window)
    if not args.no_doc:
        replace_generated_block("Steady-state overhead", "overhead", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
