"""Live replay of a spot trace on local agents: the check on the simulator (issue 27).

The busiest window of one trace (most node arrivals and losses), its counts scaled to this
machine (``--scale 0.5``: 16 nodes become 8), time-compressed (``--compress 60``: a 5-minute
tick lasts 5 s), is played on real launchers: each node is a launcher process tree (1 gloo
worker, ``examples/train.py`` with a calibrated ``--step-sleep``), on a 3-member embedded
etcd. The schedule is the simulator's own (:func:`model.node_events`, same placement and
seed): a node arrives (its launcher starts), gets its notice (SIGTERM to the launcher,
``drain_lead_s`` before the loss, scaled, for a launcher that uses notices), and is lost
(SIGKILL to its whole tree). The trace's clock starts when the first launchers start
(``--clock trace``: their cold start is in the window, as the simulator charges it) or at
the job's first step (``--clock first-step``: a short replay on a loaded machine, where
agent start-up would otherwise eat the window, still plays every event on a training job).

Then, from outside: the audit (:mod:`audit`) measures capacity goodput from the workers'
trace and checks every step's final attempt against a fault-free run (exactly once); the
simulator replays the same schedule under the launcher's costs from a
``benchmarks/recovery.py`` run; and for elasticd, ``elasticd status --goodput --json``
gives the ledger, compared with the audit's held-time goodput. One JSON document per run.

Systems: ``elasticd-live`` (``elasticd run``, live re-formation) and ``torchrun-etcd``
(torchrun's own agent on the etcd-v3 backend). torchrun's c10d backend keeps its store in
the first launcher, and a trace that drops to zero nodes ends such a job for good; the
replay has no scheduler to relaunch it, so the live check uses etcd-v3, which has the same
agent (stop everything, restart from the checkpoint) and no store host. The simulator
models the c10d store host separately (``store_host_fatal``).

Usage::

    .venv/bin/python benchmarks/recovery.py --reps 2 --scenarios sigkill,sigterm,join \\
        --systems elasticd-live,torchrun-etcd --step-s 0.1 --workdir /tmp/rec --no-doc
    .venv/bin/python -m benchmarks.spotbench.live --costs /tmp/rec/results.json \\
        --system elasticd-live --compress 60 --out /tmp/live-elasticd.json
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import (  # noqa: E402
    PY,
    ROOT,
    TORCHRUN_ENV,
    Cluster,
    NodeProc,
    elasticd_argv,
    machine_info,
    read_jsonl,
    torchrun_argv,
)
from benchmarks.spotbench.audit import audit, exactly_once, observed_costs, stretches  # noqa: E402
from benchmarks.spotbench.costs import load_costs  # noqa: E402
from benchmarks.spotbench.model import (  # noqa: E402
    JobShape,
    Ledger,
    Placement,
    SystemCosts,
    node_events,
    simulate,
)
from benchmarks.spotbench.traces import Trace, load_traces  # noqa: E402
from elasticd.config.model import LIVE_DRAIN_LEAD_S  # noqa: E402

TRACES = ROOT.parent / "shared" / "spot-traces" / "availability" / "16-node"
SYSTEMS = ("elasticd-live", "torchrun-etcd")


def busiest_window(trace: Trace, hours: float) -> int:
    """The first tick of the ``hours``-long window with the most node arrivals and losses
    (the earliest such window)."""
    c = trace.counts
    width = int(round(hours * 3600 / trace.gap_s))
    if width >= len(c) - 1:
        return 0
    moves = [abs(c[i + 1] - c[i]) for i in range(len(c) - 1)]
    best, best_at, cur = -1, 0, sum(moves[:width])
    for i in range(len(moves) - width + 1):
        if i:
            cur += moves[i + width - 1] - moves[i - 1]
        if cur > best:
            best, best_at = cur, i
    return best_at


def window_counts(trace: Trace, hours: float, scale: float, max_nodes: int,
                  first_tick: int | None = None) -> tuple[int, list[int]]:
    """(first tick, the window's counts scaled to this machine and capped at ``max_nodes``);
    the busiest window unless ``first_tick`` names where it starts."""
    start = busiest_window(trace, hours) if first_tick is None else first_tick
    width = int(round(hours * 3600 / trace.gap_s))
    return start, [min(max_nodes, int(round(n * scale))) for n in trace.counts[start:start + width + 1]]


def script_args(workdir: Path, step_s: float, checkpoint_every: int) -> list[str]:
    return ["examples/train.py", "--steps", "100000000", "--step-sleep", str(step_s),
            "--checkpoint-every", str(checkpoint_every), "--keep", "3",
            "--checkpoint-url", f"file://{workdir / 'checkpoints'}",
            "--trace", str(workdir / "trace.jsonl")]


def start_node(cluster: Cluster, system: str, node: int, job: str, etcd: str, max_nodes: int,
               args: list[str]) -> NodeProc:
    name = f"n{node}"
    logs = cluster.workdir / "logs" / name
    logs.mkdir(parents=True, exist_ok=True)
    nnodes = f"1:{max_nodes}"
    if system == "elasticd-live":
        argv = elasticd_argv(etcd, job, name, nnodes, 1, args, logs)
        env: dict[str, str] = {}
    else:
        port = int(etcd.split(",")[0].rsplit(":", 1)[1])
        argv = torchrun_argv(port, job, nnodes, 1, args, None, logs, "etcd-v3")
        env = dict(TORCHRUN_ENV)
    return cluster.start(name, argv, {**env, "PYTHONUNBUFFERED": "1"})


def first_step_time(trace: Path, cluster: Cluster, timeout_s: float) -> float:
    """When the job trained its first step (the earliest row of the workers' ``trace``),
    polled for until ``timeout_s``: the replay's clock under ``--clock first-step``, so the
    agents' cold start (long on a loaded machine) does not eat the trace's window.

    Raises:
        TimeoutError: no worker trained a step in time (the launchers' logs say why).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = read_jsonl(trace)
        if rows:
            return min(float(r["time"]) for r in rows)
        cluster.refresh()  # remember new workers, so cleanup finds them
        time.sleep(0.2)  # polling the trace file for the event, against the deadline
    raise TimeoutError(f"no step trained within {timeout_s:g} s of the first launchers' start; "
                       f"see the logs under {cluster.workdir / 'logs'}")


def reference(workdir: Path, steps: int) -> list[dict]:
    """The fault-free run: the same script at world 1, no launcher, ``steps`` steps."""
    ref = workdir / "reference.jsonl"
    if ref.exists():
        rows = read_jsonl(ref)
        if len(rows) >= steps:
            return rows
        ref.unlink()
    cmd = [PY, "examples/train.py", "--steps", str(steps), "--checkpoint-every", str(10**9),
           "--checkpoint-url", f"file://{workdir / 'ref-checkpoints'}", "--trace", str(ref)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=1800)
    return read_jsonl(ref)


def ledger(etcd: str, job: str) -> dict | None:
    """``elasticd status --goodput --json`` for the job (None if it cannot say)."""
    proc = subprocess.run([PY, "-m", "elasticd.cli", "status", "--etcd", etcd, "--job", job,
                           "--goodput", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        print(f"status --goodput said (exit {proc.returncode}): {proc.stdout[-400:]} "
              f"{proc.stderr[-400:]}", file=sys.stderr)
        return None


def dump_records(etcd: str, job: str, workdir: Path) -> None:
    """Keep the job's history record and event history beside the trace (``records.json``):
    ``--reanalyse`` computes the ledger again from them with the current code."""
    from elasticd.etcd.client import EtcdClient
    from elasticd.keys import JobKeys
    from elasticd.status.goodput import read_events

    client = EtcdClient(etcd, timeout_s=30.0)
    try:
        kv = client.get(JobKeys(job).history)
        events = read_events(client, JobKeys(job))
    finally:
        client.close()
    (workdir / "records.json").write_text(json.dumps({
        "history": None if kv is None else json.loads(kv.value),
        "events": [json.loads(e.to_json()) for e in events]}))


def recomputed_ledger(workdir: Path) -> float | None:
    """The ledger's goodput computed here from ``records.json`` (None without it)."""
    from elasticd.history import History
    from elasticd.records import Event
    from elasticd.status.goodput import compute

    path = workdir / "records.json"
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    if rec["history"] is None:
        return None
    life = compute(History.from_json(json.dumps(rec["history"])),
                   [Event.from_json(json.dumps(e)) for e in rec["events"]])
    return None if life.goodput is None else round(life.goodput, 4)


def simulated(args: argparse.Namespace, counts: list[int], gap_s: float,
              shape: JobShape) -> tuple[Ledger, SystemCosts]:
    """The simulator on the replay's own schedule, charged the system's measured costs
    (the drain lead scaled like the trace)."""
    costs = load_costs(args.costs, (args.system,))[args.system]
    if costs.uses_notice:
        costs = replace(costs, drain_lead_s=args.drain_lead_s / args.compress)
    return simulate(counts, gap_s, costs, shape, Placement.UNIFORM, args.seed), costs


def run(args: argparse.Namespace) -> dict:
    from elasticd.etcd.cluster import EmbeddedEtcdCluster

    trace = next(t for t in load_traces(args.traces) if t.name == args.trace)
    first_tick, counts = window_counts(trace, args.hours, args.scale, args.max_nodes, args.first_tick)
    gap_s = trace.gap_s / args.compress
    end_s = (len(counts) - 1) * gap_s
    notice_s = args.notice_s / args.compress
    lead_s = min(notice_s, args.drain_lead_s / args.compress)
    uses_notice = args.system == "elasticd-live"
    events = node_events(counts, gap_s, Placement.UNIFORM, args.seed, lead_s if uses_notice else 0.0)
    checkpoint_every = max(1, int(round(args.checkpoint_every_s / args.compress / args.step_s)))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=False)
    job = f"live-{args.system}-{int(time.time())}"
    sargs = script_args(workdir, args.step_s, checkpoint_every)
    info = machine_info()
    print(f"{args.system}: {trace.name} ticks {first_tick}..{first_tick + len(counts) - 1} "
          f"x{args.scale:g} (peak {max(counts)}), {len(events)} events over {end_s:.0f} s; "
          f"checkpoint every {checkpoint_every} steps", flush=True)
    etcd = EmbeddedEtcdCluster(3, str(workdir / "etcd")).start()
    changes: list[tuple[float, int]] = []
    applied: list[dict] = []
    got_ledger = None
    try:
        with Cluster(workdir) as cluster:
            nodes: dict[int, NodeProc] = {}
            t0 = time.time()
            for n in range(counts[0]):
                nodes[n] = start_node(cluster, args.system, n, job, etcd.endpoints, max(counts), sargs)
            if args.clock == "first-step":
                t0 = first_step_time(workdir / "trace.jsonl", cluster, args.first_step_timeout_s)
            for ev in events:
                if ev.t > end_s:
                    break
                while (wait := t0 + ev.t - time.time()) > 0:
                    time.sleep(min(wait, 0.2))  # the trace's clock, not a synchronisation
                    cluster.refresh()  # remember new workers, so cleanup finds them
                now = time.time() - t0
                if ev.kind == "gain":
                    nodes[ev.node] = start_node(cluster, args.system, ev.node, job, etcd.endpoints,
                                                max(counts), sargs)
                    changes.append((now, +1))
                elif ev.kind == "notice" and ev.node in nodes:
                    nodes[ev.node].signal_launcher(signal.SIGTERM)
                elif ev.kind == "loss" and ev.node in nodes:
                    nodes[ev.node].signal_node(signal.SIGKILL)
                    changes.append((now, -1))
                applied.append({"t": round(now, 3), "late_s": round(now - ev.t, 3), "kind": ev.kind,
                                "node": ev.node})
            while time.time() < t0 + end_s:
                time.sleep(0.2)
                cluster.refresh()
            if args.system == "elasticd-live":
                got_ledger = ledger(etcd.endpoints, job)
                dump_records(etcd.endpoints, job, workdir)
    finally:
        etcd.stop()
    played = {"system": args.system, "trace": trace.name, "first_tick": first_tick, "counts": counts,
              "gap_s": gap_s, "end_s": end_s, "notice_s": notice_s, "t0": t0, "changes": changes,
              "applied": applied, "checkpoint_every": checkpoint_every, "ledger": got_ledger,
              "machine": info, "job": job, "clock": args.clock}
    (workdir / "played.json").write_text(json.dumps(played))
    return analyse(args, workdir)


def analyse(args: argparse.Namespace, workdir: Path) -> dict:
    """The audit, the exactly-once check, the simulator and the ledger of a played replay
    (``--reanalyse WORKDIR`` runs only this)."""
    played = json.loads((workdir / "played.json").read_text())
    counts, gap_s, end_s, t0 = played["counts"], played["gap_s"], played["end_s"], played["t0"]
    notice_s, checkpoint_every, applied = played["notice_s"], played["checkpoint_every"], played["applied"]
    changes = [tuple(c) for c in played["changes"]]
    got_ledger, info, first_tick = played["ledger"], played["machine"], played["first_tick"]
    rows = read_jsonl(workdir / "trace.jsonl")
    measured = audit(rows, t0, changes, counts[0], end_s)
    steps = max((int(r["step"]) for r in rows), default=-1) + 1
    once = exactly_once(rows, reference(workdir, steps)) if steps else None
    shape = JobShape(min_nodes=1, max_nodes=max(counts), notice_s=notice_s, step_s=args.step_s,
                     checkpoint_every_s=checkpoint_every * args.step_s)
    seen = observed_costs(rows, t0, changes, counts[0], quiet_s=3 * gap_s)
    doc = {
        "system": args.system, "trace": played["trace"], "first_tick": first_tick, "hours": args.hours,
        "clock": played.get("clock", "trace"),
        "scale": args.scale, "compress": args.compress, "seed": args.seed, "step_s": args.step_s,
        "checkpoint_every_steps": checkpoint_every, "events": len(applied),
        "max_late_s": max((a["late_s"] for a in applied), default=0.0),
        "audit": {"goodput": round(measured.goodput, 4), "held_goodput": round(measured.held_goodput, 4),
                  "available_node_s": round(measured.available, 1), "useful_node_s": round(measured.useful, 1),
                  "held_worker_s": round(measured.held, 1), "retrained_steps": measured.retrained_steps,
                  "step_s": {str(k): round(v, 4) for k, v in sorted(measured.step_s.items())}},
        "observed_costs": {"cold_start_s": [round(x, 2) for x in seen.cold_start_s],
                           "join_s": [round(x, 2) for x in seen.join_s],
                           "loss_s": [round(x, 2) for x in seen.loss_s]},
        "stretches": [{"start": round(x.start, 1), "end": round(x.end, 1),
                       "available_node_s": round(x.available, 1), "useful_node_s": round(x.useful, 1),
                       "steps": x.steps, "first_step_s": None if x.first_step_s is None
                       else round(x.first_step_s, 2)}
                      for x in stretches(rows, t0, changes, counts[0], end_s, measured.step_s)],
        "exactly_once": None if once is None else {
            "ok": once.ok, "steps": once.steps, "skipped": once.skipped[:20],
            "duplicated": once.duplicated[:20], "wrong": once.wrong[:20],
            "incomplete_final_attempts": once.incomplete, "retrained_steps": once.retrained_steps},
        "simulator": None, "simulator_calibrated_here": None, "difference_points": None,
        "ledger": None, "machine": info, "applied": applied,
    }
    if got_ledger is not None:
        life = got_ledger.get("life", {})
        doc["ledger"] = {"goodput": life.get("goodput"), "by_cause": life.get("by_cause"),
                         "difference_points": None if life.get("goodput") is None else
                         round(100 * (life["goodput"] - measured.held_goodput), 2)}
        again = recomputed_ledger(workdir)
        if again is not None:
            doc["ledger"]["recomputed"] = {
                "goodput": again, "difference_points": round(100 * (again - measured.held_goodput), 2)}
    if not args.costs:
        return doc
    sim, costs = simulated(args, counts, gap_s, shape)
    # A noticed node has left before its loss: its loss is no kill to calibrate on.
    kills = [] if costs.uses_notice else seen.loss_s
    calibrated = replace(costs, **{k: statistics.median(v) for k, v in
                                   (("cold_start_s", seen.cold_start_s), ("join_s", seen.join_s),
                                    ("kill_s", kills)) if v})
    sim_here = simulate(counts, gap_s, calibrated, shape, Placement.UNIFORM, args.seed)
    doc["simulator"] = {"goodput": round(sim.goodput, 4), "useful_node_s": round(sim.useful, 1),
                        "available_node_s": round(sim.available, 1), "events": sim.events,
                        "lost_node_s": {k: round(v, 1) for k, v in sorted(sim.lost.items())},
                        "steps_retrained": round(sim.steps_retrained), "costs": asdict(costs)}
    doc["difference_points"] = round(100 * (sim.goodput - measured.goodput), 2)
    doc["simulator_calibrated_here"] = {
        "goodput": round(sim_here.goodput, 4),
        "cold_start_s": round(calibrated.cold_start_s, 2), "join_s": round(calibrated.join_s, 2),
        "kill_s": round(calibrated.kill_s, 2),
        "lost_node_s": {k: round(v, 1) for k, v in sorted(sim_here.lost.items())},
        "difference_points": round(100 * (sim_here.goodput - measured.goodput), 2)}
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--costs", type=Path, nargs="+",
                   help="results.json of benchmarks/recovery.py runs of this system (without: "
                        "no simulator, only the audit and the ledger)")
    p.add_argument("--traces", type=Path, default=TRACES)
    p.add_argument("--trace", default="aws-08-27-2023/us-east-2b_v100_1")
    p.add_argument("--hours", type=float, default=24.0, help="the window's length in trace time")
    p.add_argument("--first-tick", type=int, help="start the window here (default: the busiest)")
    p.add_argument("--compress", type=float, default=60.0, help="trace seconds per replay second")
    p.add_argument("--scale", type=float, default=0.5, help="nodes per trace node (16 -> 8)")
    p.add_argument("--max-nodes", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="the uniform placement's seed")
    p.add_argument("--step-s", type=float, default=0.1, help="the script's --step-sleep")
    p.add_argument("--clock", choices=("trace", "first-step"), default="trace",
                   help="trace: the window starts when the first launchers start (their cold "
                        "start is charged); first-step: it starts at the job's first step, so "
                        "a short replay stays whole on a loaded machine (the suite's)")
    p.add_argument("--first-step-timeout-s", type=float, default=300.0,
                   help="--clock first-step: how long the first step may take to come")
    p.add_argument("--checkpoint-every-s", type=float, default=600.0, help="in trace time")
    p.add_argument("--notice-s", type=float, default=120.0, help="the notice lead, trace time")
    p.add_argument("--drain-lead-s", type=float, default=LIVE_DRAIN_LEAD_S,
                   help="elasticd's drain lead, trace time (its default under live re-formation)")
    p.add_argument("--workdir", required=True, help="a new directory for logs, trace, checkpoints")
    p.add_argument("--reanalyse", action="store_true",
                   help="do not play: analyse the replay already played in --workdir")
    p.add_argument("--out", type=Path, help="write the JSON document here too")
    args = p.parse_args(argv)
    doc = analyse(args, Path(args.workdir)) if args.reanalyse else run(args)
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    summary = {k: doc[k] for k in ("system", "events", "max_late_s", "difference_points",
                                   "observed_costs", "simulator_calibrated_here")}
    print(json.dumps({**summary, "audit": doc["audit"]["goodput"],
                      "simulator": (doc["simulator"] or {}).get("goodput"),
                      "exactly_once": doc["exactly_once"], "ledger": doc["ledger"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
