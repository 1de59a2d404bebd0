"""Training through etcd member failures: a 3-member cluster, two agents, five faults.

Each scenario starts a fresh 3-member ``EmbeddedEtcdCluster`` on loopback and two
``elasticd run`` nodes (``--nnodes 2``, one gloo worker each, examples/train.py) given
every member's endpoint, waits for training, injects one fault, lets the job run on, and
reports:

- worker restarts: ``agent_decided`` events with a restart verdict (both agents), and
  ``lease_lost`` events (a lease that expired under a healthy node);
- steps lost: rank 0's steps trained more than once (the trace of examples/train.py);
- stall: a probe in this process (``--probes`` EtcdClients on all endpoints, the agents'
  call timeout, each looping put+get on a key of its own) records its longest gap between
  two successful calls during the scenario: median and max over the probes; and the
  agents' own longest keep-alive outage (``lease_keepalive_failed`` → ``_resumed``).

Scenarios (the member an agent talks to is found from /proc; "leader" is made so with
etcd's MoveLeader first, so the agent's own member is always the one hit)::

    leader_kill      SIGKILL the leader (an agent's member), restart it after 8 s
    follower_kill    SIGKILL a follower (an agent's member), restart it after 8 s
    leader_freeze    SIGSTOP the leader (an agent's member) for TTL + 1 s, then SIGCONT
    rolling_restart  SIGTERM + restart each member in turn, waiting for it to serve
    quorum_loss      SIGKILL two members (the leader among them) for 10 s, restart both

Usage::

    .venv/bin/python benchmarks/etcd_failover.py               # all five, ~4 min
    .venv/bin/python benchmarks/etcd_failover.py --scenarios leader_kill --no-doc
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    PY,
    ROOT,
    Cluster,
    iso_to_epoch,
    json_in_line,
    machine_info,
    machine_line,
    other_load,
    read_jsonl,
    replace_generated_block,
    sigterm_as_interrupt,
    wait_until,
)
from elasticd.etcd.client import EtcdClient  # noqa: E402
from elasticd.etcd.cluster import EmbeddedEtcdCluster  # noqa: E402

SCENARIOS = ["leader_kill", "follower_kill", "leader_freeze", "rolling_restart", "quorum_loss"]


class Probe:
    """EtcdClients looping put+get; each records its longest gap between two successes."""

    def __init__(self, endpoints: str, count: int, timeout_s: float) -> None:
        self.clients = [EtcdClient(endpoints, timeout_s=timeout_s) for _ in range(count)]
        self.gaps = [0.0] * count
        self.last_ok = [time.monotonic()] * count
        self.calls = [0] * count
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def start(self) -> Probe:
        for t in self._threads:
            t.start()
        return self

    def reset(self) -> None:
        now = time.monotonic()
        self.gaps = [0.0] * len(self.clients)
        self.last_ok = [now] * len(self.clients)

    def _run(self, i: int) -> None:
        client = self.clients[i]
        while not self._stop.is_set():
            try:
                client.put(f"/probe/{i}", str(time.time()))
                client.get(f"/probe/{i}")
                now = time.monotonic()
                self.gaps[i] = max(self.gaps[i], now - self.last_ok[i])
                self.last_ok[i] = now
                self.calls[i] += 1
            except Exception:  # a stall: measured by the gap to the next success
                pass
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        for c in self.clients:
            c.close()


def _member_of(cluster: EmbeddedEtcdCluster, pid: int) -> int:
    used = wait_until(lambda: [i for i in cluster.members_used_by(pid) if cluster.members[i].running], 10)
    return int(used[0])


def _inject(name: str, cluster: EmbeddedEtcdCluster, agent_pid: int, ttl_s: int) -> None:
    """Run one fault to completion (the cluster is whole again when this returns)."""
    target = _member_of(cluster, agent_pid)
    if name == "leader_kill":
        cluster.move_leader(target)
        cluster.kill(target)
        time.sleep(8)
        cluster.restart(target)
    elif name == "follower_kill":
        cluster.move_leader((target + 1) % 3)
        cluster.kill(target)
        time.sleep(8)
        cluster.restart(target)
    elif name == "leader_freeze":
        cluster.move_leader(target)
        cluster.freeze(target)
        time.sleep(ttl_s + 1)
        cluster.resume(target)
    elif name == "rolling_restart":
        for i in range(3):
            cluster.stop_member(i)
            time.sleep(2)
            cluster.restart(i)
            cluster.wait_leader()
            time.sleep(2)
    elif name == "quorum_loss":
        cluster.move_leader(target)
        other = (target + 1) % 3
        cluster.kill(target)
        cluster.kill(other)
        time.sleep(10)
        cluster.restart(target, wait=False)
        cluster.restart(other)
    else:
        raise ValueError(name)


def run_scenario(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    sdir = workdir / name
    sdir.mkdir(parents=True, exist_ok=True)
    trace = sdir / "trace.jsonl"
    etcd = EmbeddedEtcdCluster(3, str(sdir / "etcd")).start()
    result: dict = {"scenario": name}
    probe = None
    try:
        with Cluster(sdir) as nodes:
            script = [str(ROOT / "examples" / "train.py"), "--steps", "1000000", "--dataset-size",
                      "4096", "--global-batch", "8", "--micro-batch", "8", "--checkpoint-every",
                      str(args.checkpoint_every), "--step-sleep", "0.05", "--trace", str(trace), "--checkpoint-url",
                      f"file://{sdir}/ckpt"]
            agents = [nodes.start(f"n{i}", [
                PY, "-m", "elasticd.cli", "run", "--etcd", etcd.endpoints, "--job", f"fo-{name}",
                "--nnodes", "2", "--nproc-per-node", "1", "--node-ttl", str(args.node_ttl),
                "--etcd-timeout", str(args.etcd_timeout), "--local-addr", "127.0.0.1",
                "--log-format", "json", "--node-id", f"n{i}", *script]) for i in range(2)]
            rank0 = lambda: [r for r in read_jsonl(trace) if r.get("rank") == 0]  # noqa: E731
            wait_until(lambda: len(rank0()) >= 20, 120)
            probe = Probe(etcd.endpoints, args.probes, args.etcd_timeout).start()
            wait_until(lambda: min(probe.calls) >= 3, 30)
            probe.reset()
            steps_before = len(rank0())
            t_fault = time.time()
            _inject(name, etcd, agents[0].pid, args.node_ttl)
            t_whole = time.time()
            time.sleep(args.after)
            # Count what a restart would cost too: wait until training runs again after the
            # fault (a restarted group takes a while to trace its first step).
            done_at = len(rank0())
            try:
                wait_until(lambda: len(rank0()) >= done_at + 20, 120)
            except Exception:  # reported as few steps_during; the counts stay exact
                pass
            gaps = sorted(probe.gaps)
            rows = rank0()
            attempts = Counter(r["step"] for r in rows)
            events = [(n.name, json_in_line(text)) for n in agents for _, text in n.lines]
            events = [(who, e) for who, e in events if e and "event" in e]
            result.update(
                restarts=sum(1 for _, e in events if e["event"] == "agent_decided"
                             and str(e.get("verdict", "")).startswith("restart")),
                leases_lost=sum(1 for _, e in events if e["event"] == "lease_lost"),
                steps_lost=sum(c - 1 for c in attempts.values()),
                rounds=len({r["round"] for r in rows}),
                steps_during=len(rows) - steps_before,
                fault_s=round(t_whole - t_fault, 1),
                stall_median_s=round(statistics.median(gaps), 2),
                stall_max_s=round(gaps[-1], 2),
                agent_keepalive_outage_s=round(_keepalive_outage(events), 2),
                agents_alive=all(a.alive() for a in agents),
            )
    finally:
        if probe is not None:
            probe.stop()
        etcd.stop()
    return result


def _keepalive_outage(events: list[tuple[str, dict]]) -> float:
    """Longest time an agent's keep-alives failed (first failure → resumed)."""
    worst, since = 0.0, {}
    for who, e in events:
        if e["event"] == "lease_keepalive_failed" and who not in since:
            since[who] = iso_to_epoch(e["timestamp"])
        elif e["event"] == "lease_keepalive_resumed" and who in since:
            worst = max(worst, iso_to_epoch(e["timestamp"]) - since.pop(who))
    return worst


def report(results: list[dict], info: dict, argv: list[str], busy: list[str], args: argparse.Namespace) -> str:
    rows = ["| scenario | fault lasted (s) | worker restarts | leases lost | steps lost | "
            "steps trained during | probe stall median (s) | probe stall max (s) | "
            "agents' longest keep-alive outage (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['scenario']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        rows.append(f"| {r['scenario']} | {r['fault_s']} | {r['restarts']} | {r['leases_lost']} | "
                    f"{r['steps_lost']} | {r['steps_during']} | {r['stall_median_s']} | "
                    f"{r['stall_max_s']} | {r['agent_keepalive_outage_s']} |")
    shared = (f" The machine was shared (other busy processes at the start: {len(busy)}); "
              "stalls include scheduling delays.") if busy else ""
    return "\n".join([
        f"Measured {machine_line(info)}.{shared}",
        "",
        "```",
        f".venv/bin/python benchmarks/etcd_failover.py {' '.join(argv)}".rstrip(),
        "```",
        "",
        f"A 3-member etcd on loopback (etcd defaults: heartbeat 100 ms, election timeout "
        f"1000 ms), two `elasticd run` nodes given all three endpoints, `--node-ttl "
        f"{args.node_ttl} --etcd-timeout {args.etcd_timeout}`, examples/train.py "
        f"(checkpoint every {args.checkpoint_every} steps, 0.05 s/step). The faulted member is the one agent n0 "
        f"talks to. Probe stall: {args.probes} clients in the benchmark process looping "
        f"put+get; the longest gap between two successes of each, median and max over the "
        f"clients. `{args.after:.0f}` s of training follow each fault.",
        "",
        *rows,
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--node-ttl", type=int, default=5, help="agents' --node-ttl (default: the product's)")
    p.add_argument("--etcd-timeout", type=float, default=3.0, help="agents' and probes' call timeout")
    p.add_argument("--probes", type=int, default=6)
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--after", type=float, default=6.0, help="seconds of training after each fault")
    p.add_argument("--workdir")
    p.add_argument("--no-doc", action="store_true")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="elasticd-failover-"))
    info, busy = machine_info(), other_load()
    results = []
    run: Callable[[str], dict] = lambda s: run_scenario(s, args, workdir)  # noqa: E731
    with sigterm_as_interrupt():
        for name in [s for s in args.scenarios.split(",") if s]:
            try:
                r = run(name)
            except Exception as exc:  # report it, go on with the next scenario
                r = {"scenario": name, "error": f"{type(exc).__name__}: {exc}"}
            results.append(r)
            print(json.dumps(r), flush=True)
    (workdir / "results.json").write_text(json.dumps({"machine": info, "results": results}, indent=1))
    text = report(results, info, sys.argv[1:], busy, args)
    if not args.no_doc:
        replace_generated_block("etcd member failures", f"etcd_failover-ckpt{args.checkpoint_every}", text,
                                generator="benchmarks/etcd_failover.py")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
