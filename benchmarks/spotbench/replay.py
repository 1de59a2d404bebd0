"""Replay public spot availability traces under each launcher's measured event costs.

For every trace, launcher, event placement and seed, :func:`model.simulate` walks the trace
and returns where the node-seconds went; this prints one row per (trace, launcher) with the
median over placements and seeds (and their range), writes every replay as one JSONL line,
and, with ``--doc``, rewrites the generated block in docs/benchmarks.md.

Usage::

    # per-event costs: a recovery run of the four launchers (about 15 minutes here)
    .venv/bin/python benchmarks/recovery.py --reps 2 --scenarios sigkill,sigterm,join \\
        --systems elasticd-live,elasticd,torchrun-tuned,torchrun-etcd --workdir /tmp/rec --no-doc
    # the replay (seconds)
    .venv/bin/python -m benchmarks.spotbench.replay --results /tmp/rec/results.json \\
        --notice-s 120 --out /tmp/spot.jsonl

Assumptions, all flags: the job asks for the whole pool (``--nnodes 1:16``), checkpoints
every 10 minutes, a node is paid for while it is available, one GPU per node at the stated
spot price.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.spotbench.costs import SYSTEMS, fixed_size, load_costs  # noqa: E402
from benchmarks.spotbench.model import JobShape, Ledger, Placement, SystemCosts, simulate  # noqa: E402
from benchmarks.spotbench.projection import SOURCES, GpuJob, project  # noqa: E402
from benchmarks.spotbench.traces import Trace, load_traces  # noqa: E402
from elasticd.config.model import RESTART_DRAIN_LEAD_S, PreemptionConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "spot-traces" / "availability" / "16-node"
#: An assumed spot price for one V100 node (p3.2xlarge); cost per useful GPU-hour scales with it.
PRICE_PER_NODE_HOUR = 0.92


def replay_all(traces: list[Trace], systems: dict[str, SystemCosts], job: JobShape,
               placements: list[Placement], seeds: list[int]) -> list[dict]:
    """One record per (trace, system, placement, seed): the ledger and its inputs."""
    rows = []
    for trace in traces:
        for name, costs in systems.items():
            for placement in placements:
                for seed in (seeds if placement is Placement.UNIFORM else [0]):
                    # A fixed-size job is the pool's full size (what every node was bought for).
                    shape = job if costs.elastic else JobShape(**{**asdict(job),
                                                                 "min_nodes": trace.peak})
                    shape = JobShape(**{**asdict(shape), "max_nodes": max(shape.max_nodes, trace.peak)})
                    led = simulate(trace.counts, trace.gap_s, costs, shape, placement, seed)
                    rows.append(_row(trace, name, placement, seed, led))
    return rows


def _row(trace: Trace, system: str, placement: Placement, seed: int, led: Ledger) -> dict:
    useful_h = led.useful / 3600
    return {"trace": trace.name, "system": system, "placement": placement.value, "seed": seed,
            "available_node_h": round(led.available / 3600, 3), "paid_node_h": round(led.paid / 3600, 3),
            "useful_node_h": round(useful_h, 3), "goodput": round(led.goodput, 5),
            "retrained_node_h": round(led.retrained / 3600, 3),
            "steps_retrained": round(led.steps_retrained),
            "usd_per_useful_gpu_h": round(PRICE_PER_NODE_HOUR * led.paid / led.useful, 4)
            if led.useful > 0 else None,
            "events": led.events,
            "lost_node_h": {k: round(v / 3600, 3) for k, v in sorted(led.lost.items())}}


def table(rows: list[dict], baseline: str = "torchrun-tuned") -> str:
    """Markdown: one row per (trace, system), median (min–max) over placements and seeds."""
    out = ["| trace | launcher | capacity goodput | badput ÷ torchrun's | node-h retrained "
           "| steps retrained | $ / useful GPU-h |",
           "|---|---|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["trace"], r["system"]) for r in rows}, key=lambda k: (k[0], _order(k[1])))
    med = {k: statistics.median(r["goodput"] for r in rows if (r["trace"], r["system"]) == k)
           for k in keys}
    for trace, system in keys:
        sel = [r for r in rows if r["trace"] == trace and r["system"] == system]
        g = [r["goodput"] for r in sel]
        base = med.get((trace, baseline))
        ratio = (1 - med[(trace, system)]) / (1 - base) if base is not None and base < 1 else None
        usd = [r["usd_per_useful_gpu_h"] for r in sel if r["usd_per_useful_gpu_h"] is not None]
        out.append(
            f"| {trace} | {system} | {statistics.median(g):.4f} ({min(g):.4f}–{max(g):.4f}) | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{statistics.median(r['retrained_node_h'] for r in sel):.1f} | "
            f"{statistics.median(r['steps_retrained'] for r in sel):.0f} | "
            f"{f'{statistics.median(usd):.3f}' if usd else '-'} |")
    return "\n".join(out)


def _lead(system: str, configured: float | None) -> float:
    """The drain lead elasticd uses for ``system``: as configured, else its default for the
    system's recovery path (``PreemptionConfig.lead_s``)."""
    return PreemptionConfig(drain_lead_s=configured).lead_s(live_reform=system == "elasticd-live")


def _order(system: str) -> tuple[int, str]:
    ranked = [*SYSTEMS, *(f"{s} (lead 60 s)" for s in SYSTEMS),
              *(f"{s} (drain at notice)" for s in SYSTEMS), *(f"{s} (fixed)" for s in SYSTEMS)]
    return (ranked.index(system) if system in ranked else len(ranked), system)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--results", type=Path, required=True, nargs="+",
                   help="results.json of benchmarks/recovery.py runs with the four launchers "
                        "(trials pooled)")
    p.add_argument("--traces", type=Path, default=TRACES, help="folder of trace JSON files")
    p.add_argument("--notice-s", type=float, default=120.0,
                   help="preemption notice lead, s (AWS 120, GCP 30, 0 none)")
    p.add_argument("--drain-lead-s", type=float, default=None,
                   help="elasticd's preemption.drain_lead_s (unset, its default: 20 s with live "
                        "re-formation, 60 s on the restart path)")
    p.add_argument("--checkpoint-every-s", type=float, default=600.0,
                   help="seconds between saves (with --checkpoint-auto: the first interval)")
    p.add_argument("--checkpoint-auto", action="store_true",
                   help='[checkpoint] every = "auto": Young-Daly re-chosen after every save and '
                        "rollback from the rollbacks seen so far (elasticd.checkpoint.cadence)")
    p.add_argument("--save-block-s", type=float, default=0.0,
                   help="seconds each save blocks the loop (charged as checkpoint_block)")
    p.add_argument("--save-write-s", type=float, default=0.0,
                   help="seconds each save takes to be written (the cadence's floor)")
    p.add_argument("--min-nodes", type=int, default=1)
    p.add_argument("--step-s", type=float, default=1.0, help="one step's wall time, for steps retrained")
    p.add_argument("--seeds", type=int, default=5, help="seeds of the uniform placement")
    p.add_argument("--out", type=Path, help="write every replay as one JSON line here")
    p.add_argument("--project-7b", action="store_true",
                   help="project each cost to a 7B HSDP job on 16 x 8 GPUs (projection.py)")
    p.add_argument("--nic-gbps", type=float, default=GpuJob.nic_gbps)
    p.add_argument("--s3-gbps", type=float, default=GpuJob.s3_gbps)
    p.add_argument("--nccl-init-s", type=float, default=GpuJob.nccl_init_s)
    p.add_argument("--compile-cold-s", type=float, default=GpuJob.compile_cold_s)
    p.add_argument("--compile-cached-s", type=float, default=GpuJob.compile_cached_s)
    args = p.parse_args(argv)
    costs = load_costs(args.results)
    if args.project_7b:
        gpu = GpuJob(nic_gbps=args.nic_gbps, s3_gbps=args.s3_gbps, nccl_init_s=args.nccl_init_s,
                     compile_cold_s=args.compile_cold_s, compile_cached_s=args.compile_cached_s)
        trials = [t for path in args.results for t in json.loads(path.read_text())["trials"]]
        costs = {n: project(c, trials, gpu) for n, c in costs.items()}
        print("projection to a 7B HSDP job, 16 nodes x 8 GPUs:")
        for k, v in gpu.parts().items():
            print(f"  {k}: {v:.2f}")
        for k, src in SOURCES.items():
            print(f"  {k} = {getattr(gpu, k)}: {src}")
    # elasticd as shipped drains with preemption.drain_lead_s left (unset: by its recovery
    # path); before, at the notice, and with 60 s on the live path.
    at_notice = {f"{n} (drain at notice)": c for n, c in costs.items() if c.uses_notice}
    lead_60 = {f"{n} (lead 60 s)": replace(c, drain_lead_s=RESTART_DRAIN_LEAD_S)
               for n, c in costs.items() if n == "elasticd-live" and args.drain_lead_s is None}
    costs = {n: replace(c, drain_lead_s=_lead(n, args.drain_lead_s)) if c.uses_notice else c
             for n, c in costs.items()}
    systems = {**costs, **lead_60, **at_notice,
               "torchrun-tuned (fixed)": fixed_size(costs["torchrun-tuned"])}
    job = JobShape(min_nodes=args.min_nodes, max_nodes=16, checkpoint_every_s=args.checkpoint_every_s,
                   notice_s=args.notice_s, step_s=args.step_s, save_block_s=args.save_block_s,
                   save_write_s=args.save_write_s, checkpoint_auto=args.checkpoint_auto)
    traces = load_traces(args.traces)
    rows = replay_all(traces, systems, job, list(Placement), list(range(args.seeds)))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("costs (s):")
    for name, c in systems.items():
        print(f"  {name}: kill {c.kill_s:.2f}, drain {c.drain_s:.2f}, join {c.join_s:.2f} "
              f"(members pause {c.join_pause_s:.2f}), rollback on kill {c.kill_rollback}, "
              f"store host fatal {c.store_host_fatal}")
    print(table(rows))
    print()
    print(causes(rows))
    return 0


def causes(rows: list[dict]) -> str:
    """Markdown: where each launcher's badput went (share of available node-time, median
    over traces, placements and seeds)."""
    names = sorted({k for r in rows for k in r["lost_node_h"]})
    systems = sorted({r["system"] for r in rows}, key=_order)
    out = ["| launcher | " + " | ".join(n.replace("_", " ") for n in names) + " |",
           "|---|" + "---:|" * len(names)]
    for system in systems:
        sel = [r for r in rows if r["system"] == system]
        cells = [statistics.median(r["lost_node_h"].get(n, 0.0) / r["available_node_h"] for r in sel)
                 for n in names]
        out.append(f"| {system} | " + " | ".join(f"{100 * c:.2f} %" for c in cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
