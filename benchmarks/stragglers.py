"""A straggler made slower from outside: flagged, ejected, the job's rate, re-admission.

Issue 24's straggler numbers, on 3 "nodes" (``elasticd run`` agents, 1 gloo worker each,
``examples/train.py`` with live re-formation, one embedded etcd), in one run:

1. **Control arm**: a healthy job of N-1 = 2 nodes; its steps/s is the rate a job without
   the straggler can reach on this machine (same script, same step, same global batch).
2. **Straggler arm**: 3 healthy nodes (their steps/s), then a SIGSTOP/SIGCONT duty cycle
   on the last node's worker (``--stop-s`` stopped, ``--cont-s`` running; the fault
   injection, not a synchronisation). Measured: slowed -> flagged (``stragglers_flagged``
   in an agent's log), slowed -> ejected (``member_ejected``), the rate while slowed, the
   rate after the ejection against the control arm, the first moment a sliding window of
   ``--rate-window-s`` after the slowdown is within 2 % of the control arm's rate, and
   the node's first step back at world 3 after its probation (its agent killed the
   slowed worker, which ends the injected fault: the node "recovered").
3. With ``--still-slow``, the node did not recover: its new worker is slowed again from its
   first step back at world 3 (instead of the re-admitted rate of item 2). Measured: its
   second ejection, the probation it gets (twice the first), and the trial's cost (the
   steps the job missed against the control arm's rate from the re-admission until the
   first step at world 2 again; and that cost over the cycle it starts once the probation
   has doubled to its cap, 8x).

Rates come from the workers' ``--trace`` lines (rank 0's steps, their own wall clock).

Usage::

    .venv/bin/python benchmarks/stragglers.py                      # default window and probation
    .venv/bin/python benchmarks/stragglers.py --window 10 --probation 20 --out /tmp/s.json
    .venv/bin/python benchmarks/stragglers.py --still-slow --out /tmp/s.json   # a node that stays slow
    .venv/bin/python benchmarks/stragglers.py --script examples/fsdp_train.py \
        --script-args "--mesh fsdp --live --peer-replica-every 50 --global-batch 48 --micro-batch 8"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    TRAIN_SCRIPT,
    Cluster,
    NodeProc,
    elasticd_argv,
    machine_info,
    other_load,
    read_jsonl,
    sigterm_as_interrupt,
    wait_until,
)

NODES = 3


def rank0_steps(trace: Path) -> list[tuple[float, int, int]]:
    """(time, step, world) of rank 0's steps, by time (the last attempt of a step wins)."""
    rows = {r["step"]: (r["time"], r["step"], r["world"]) for r in read_jsonl(trace) if r.get("rank") == 0}
    return sorted(rows.values())


def rate(steps: list[tuple[float, int, int]], t0: float, t1: float, world: int | None = None) -> float:
    """Steps per second completed in [t0, t1) (at ``world`` if given)."""
    n = sum(1 for t, _, w in steps if t0 <= t < t1 and (world is None or w == world))
    return n / (t1 - t0) if t1 > t0 else 0.0


def _range(start: float, stop: float, step: float) -> list[float]:
    return [start + i * step for i in range(max(int((stop - start) // step) + 1, 0))]


def first_event(nodes: list[NodeProc], event: str, after: float) -> tuple[float, dict] | None:
    """(arrival time, record) of the first agent log line of ``event`` after ``after``."""
    found = []
    for n in nodes:
        for at, text in list(n.lines):
            if at > after and f'"{event}"' in text:
                try:
                    found.append((at, json.loads(text[text.index("{"):])))
                except ValueError:
                    continue
    return min(found, key=lambda x: x[0]) if found else None


def start_job(cluster: Cluster, endpoint: str, job: str, n: int, trace: Path,
              args: argparse.Namespace, nnodes: str) -> None:
    script = [args.script, "--steps", "100000000", "--step-sleep", str(args.step_s),
              "--checkpoint-url", f"file://{cluster.workdir / 'ckpt'}", "--checkpoint-every", "100",
              "--trace", str(trace), *shlex.split(args.script_args)]
    flags = ["--straggler-window", str(args.window), "--straggler-probation", str(args.probation)]
    for i in range(n):
        logs = cluster.workdir / "logs" / f"n{i}"
        logs.mkdir(parents=True, exist_ok=True)
        cluster.start(f"n{i}", elasticd_argv(endpoint, job, f"n{i}", nnodes, 1, [*flags, *script], logs),
                      {"PYTHONUNBUFFERED": "1"})


def steady(trace: Path, world: int, warm_steps: int, timeout_s: float) -> float:
    """Wait for ``warm_steps`` steps at ``world``; returns the time of the last one."""
    got = wait_until(lambda: [s for s in rank0_steps(trace) if s[2] == world][warm_steps - 1:], timeout_s, 0.2)
    if not got:
        raise SystemExit(f"never trained {warm_steps} steps at world {world} within {timeout_s:.0f}s")
    return got[0][0]


def control_arm(root: Path, endpoint: str, args: argparse.Namespace) -> float:
    """The healthy N-1 node job's steps/s."""
    work = root / "control"
    work.mkdir(parents=True)
    trace = work / "trace.jsonl"
    with Cluster(work) as cluster:
        start_job(cluster, endpoint, f"strag-ctl-{int(time.time())}", NODES - 1, trace, args, "2:3")
        t0 = steady(trace, NODES - 1, args.warm_steps, args.start_timeout) + args.settle_s
        wait_until(lambda: time.time() >= t0 + args.measure_s, args.measure_s + args.settle_s + 5, 0.2)
        return rate(rank0_steps(trace), t0, t0 + args.measure_s, NODES - 1)


def node_worker(node: NodeProc, trace: Path, after: float = 0.0) -> int:
    """The PID of ``node``'s one worker that wrote a trace row after ``after`` (waits up
    to 10 s for its first row)."""
    def found() -> list[int] | None:
        pids = {r["pid"] for r in read_jsonl(trace) if r["time"] >= after}  # every rank's worker
        worker = [p for p in node.tree() if p in pids]
        return worker if len(worker) == 1 else None

    worker = wait_until(found, 10, 0.2)
    if not worker:
        raise SystemExit(f"cannot tell the node's worker after {after:.1f}")
    return worker[0]


def slowed_until_ejected(cluster: Cluster, pid: int,
                         args: argparse.Namespace) -> tuple[float, tuple | None, tuple | None]:
    """A SIGSTOP/SIGCONT duty cycle on ``pid`` (the fault injection: ``--stop-s`` stopped,
    ``--cont-s`` running) until an agent logs ``member_ejected`` (bounded); (the slowdown's
    start, the first ``stragglers_flagged`` after it, the ``member_ejected`` after it)."""
    stop = threading.Event()

    def duty_cycle() -> None:
        while not stop.is_set():
            for sig, hold in ((signal.SIGSTOP, args.stop_s), (signal.SIGCONT, args.cont_s)):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    return
                stop.wait(hold)

    slowed = time.time()
    injector = threading.Thread(target=duty_cycle, daemon=True)
    injector.start()
    try:
        limit = args.window * 3 + 60
        flagged = wait_until(lambda: first_event(cluster.nodes, "stragglers_flagged", slowed), limit, 0.2)
        ejected = wait_until(lambda: first_event(cluster.nodes, "member_ejected", slowed), limit, 0.2)
    finally:
        stop.set()
        injector.join(5)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return slowed, flagged, ejected


def straggler_arm(root: Path, endpoint: str, args: argparse.Namespace, control: float) -> dict:
    work = root / "straggler"
    work.mkdir(parents=True)
    trace = work / "trace.jsonl"
    out: dict = {}
    with Cluster(work) as cluster:
        start_job(cluster, endpoint, f"strag-{int(time.time())}", NODES, trace, args, "2:3")
        t0 = steady(trace, NODES, args.warm_steps, args.start_timeout) + args.settle_s
        wait_until(lambda: time.time() >= t0 + args.measure_s, args.measure_s + args.settle_s + 5, 0.2)
        out["healthy_3_steps_per_s"] = rate(rank0_steps(trace), t0, t0 + args.measure_s, NODES)
        victim = cluster.nodes[-1]
        slowed, flagged, ejected = slowed_until_ejected(cluster, node_worker(victim, trace), args)
        if flagged:
            out["flagged_after_s"] = round(flagged[0] - slowed, 2)
            out["flagged_ratio"] = flagged[1].get("nodes", {})
        if not ejected:
            out["note"] = "never ejected"
            return out
        t_ej = ejected[0]
        out["ejected_after_s"] = round(t_ej - slowed, 2)
        out["ejection"] = {k: ejected[1].get(k) for k in ("cause", "ejected", "probation_s", "reason")}
        out["slowed_3_steps_per_s"] = rate(rank0_steps(trace), slowed + 2, t_ej, NODES)
        # The rate after the ejection, over the probation (world 2 only): settled (from
        # --settle-s after the first step at world 2), and every 5 s.
        end = t_ej + args.probation * 0.9
        wait_until(lambda: time.time() >= end, args.probation + 10, 0.2)
        steps = rank0_steps(trace)
        first2 = next((t for t, _, w in steps if t > t_ej and w == NODES - 1), None)
        if first2 is not None:
            out["first_step_at_2_after_ejection_s"] = round(first2 - t_ej, 3)
            out["after_ejection_2_steps_per_s"] = rate(steps, first2 + args.settle_s, end, NODES - 1)
            out["after_ejection_every_5s"] = [round(rate(steps, t, t + 5), 2)
                                              for t in _range(first2, end - 5, 5)]
        # When a sliding window first reached 98 % of the control arm's rate.
        w = args.rate_window_s
        t = slowed
        while t + w <= end:
            if rate(steps, t, t + w) >= 0.98 * control:
                out["within_2pct_of_control_after_s"] = round(t + w - slowed, 1)
                break
            t += 0.5
        after = first2 if first2 is not None else t_ej  # steps at 3 still landing at the ejection
        back = wait_until(lambda: next((s for s in rank0_steps(trace) if s[0] > after and s[2] == NODES),
                                       None),
                          args.probation * 2 + 60, 0.2)
        if back:
            out["readmitted_after_ejection_s"] = round(back[0] - t_ej, 2)
            if args.still_slow:  # slowed again from its first step back: it did not recover
                out["still_slow"] = still_slow(cluster, victim, trace, args, control, back[0])
            else:
                t3 = back[0] + args.settle_s
                wait_until(lambda: time.time() >= t3 + args.measure_s,
                           args.measure_s + args.settle_s + 5, 0.2)
                out["readmitted_3_steps_per_s"] = rate(rank0_steps(trace), t3, t3 + args.measure_s, NODES)
        rows = read_jsonl(trace)
        out["retrained_steps"] = len(rows) - len({(r["step"], r["rank"]) for r in rows})
    return out


def still_slow(cluster: Cluster, victim: NodeProc, trace: Path, args: argparse.Namespace,
               control: float, back: float) -> dict:
    """The re-admitted node slowed again from ``back``, its first step at world 3 (a node
    that did not recover): when it is ejected again, for how long (its probation doubles;
    a re-admission is judged on the trial window), and what the trial cost: the
    steps the job missed, against the control arm's rate, from the re-admission to the
    first step at world 2 after the second ejection."""
    slowed, flagged, ejected = slowed_until_ejected(cluster, node_worker(victim, trace, back), args)
    out: dict = {"slowed_after_readmission_s": round(slowed - back, 2)}
    if flagged:
        out["flagged_after_s"] = round(flagged[0] - slowed, 2)
    if not ejected:
        out["note"] = "never ejected again"
        return out
    t_ej = ejected[0]
    out["ejected_after_s"] = round(t_ej - slowed, 2)
    out["probation_s"] = ejected[1].get("probation_s")
    first2 = wait_until(lambda: next((t for t, _, w in rank0_steps(trace) if t > t_ej and w == NODES - 1),
                                     None), 60, 0.2)
    if first2 is not None:
        steps = [s for s in rank0_steps(trace) if back <= s[0] <= first2]
        out["trial_s"] = round(first2 - back, 2)
        out["trial_steps"] = len(steps)
        out["trial_steps_missed_vs_control"] = round(control * (first2 - back) - len(steps), 1)
        # A node that never recovers is tried once per probation, which doubles up to 8x the
        # base: what each trial costs over the cycle it starts, at the cap.
        cap = args.probation * 8
        out["cost_per_cycle_at_cap_pct"] = round(
            100 * out["trial_steps_missed_vs_control"] / (control * (cap + first2 - back)), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=30.0, help="--straggler-window, s (default 30)")
    p.add_argument("--probation", type=float, default=60.0, help="--straggler-probation, s (default 60)")
    p.add_argument("--step-s", type=float, default=0.05, help="--step-sleep of the script, s")
    p.add_argument("--script", default=TRAIN_SCRIPT, help="the training script (examples/train.py's "
                   "flags; e.g. examples/fsdp_train.py)")
    p.add_argument("--script-args", default="", help="more arguments of the script, one string "
                   '(e.g. "--mesh fsdp --live --global-batch 48 --micro-batch 8")')
    p.add_argument("--stop-s", type=float, default=0.05, help="the duty cycle's stopped time, s")
    p.add_argument("--cont-s", type=float, default=0.1, help="the duty cycle's running time, s")
    p.add_argument("--warm-steps", type=int, default=20)
    p.add_argument("--settle-s", type=float, default=8.0, help="after warm-up, before measuring")
    p.add_argument("--measure-s", type=float, default=15.0, help="each rate's window, s")
    p.add_argument("--rate-window-s", type=float, default=10.0, help="the sliding window, s")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--still-slow", action="store_true",
                   help="after the re-admission, slow the node again: its second ejection, "
                        "its doubled probation and what the trial cost")
    p.add_argument("--out", help="write the results JSON here")
    args = p.parse_args(argv)
    from elasticd.etcd.embedded import EmbeddedEtcd

    root = Path(tempfile.mkdtemp(prefix="elasticd-stragglers-"))
    info, busy = machine_info(), other_load()
    etcd = EmbeddedEtcd(data_dir=str(root / "etcd"))
    started = time.time()
    with sigterm_as_interrupt():
        try:
            etcd.start()
            control = control_arm(root, etcd.endpoint, args)
            print(f"control arm: healthy {NODES - 1} nodes {control:.2f} steps/s", flush=True)
            result = straggler_arm(root, etcd.endpoint, args, control)
        finally:
            etcd.stop(remove_data=False)
    doc = {"machine": info, "argv": sys.argv[1:], "control_2_steps_per_s": control, **result,
           "after_over_control": (round(result["after_ejection_2_steps_per_s"] / control, 3)
                                  if control and result.get("after_ejection_2_steps_per_s") else None),
           "wall_s": round(time.time() - started, 1), "busy": sorted(set(busy) | set(other_load())),
           "logs": str(root)}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
