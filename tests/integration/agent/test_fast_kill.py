"""End to end: a SIGKILLed node is proven gone by its liveness probe, not by its lease.

Real etcd, real agents, real workers, real signals. The lease TTL and the last call are
both 20 s here, so a survivor that waited for either (the code before the liveness probe)
could not train at the new size within the bound below.
"""

from __future__ import annotations

import signal
import time

import pytest
from harness import ROOT, example_args, read_jsonl, wait_until

SCRIPT = str(ROOT / "examples" / "train.py")
SLOW = ["--node-ttl", "20", "--last-call-timeout", "20"]


@pytest.mark.timeout(150)
def test_killed_coordinator_is_proven_dead_and_the_survivor_trains_on_in_place(nodes, tmp_path):
    """SIGKILL of the coordinator node: the survivor unseats it (probe refused), becomes
    coordinator, closes the next round without the 20 s last call or lease, and its worker
    (same PID) trains on at world 1 within a few seconds."""
    trace = tmp_path / "trace-k.jsonl"
    args = ["--checkpoint-url", f"file://{tmp_path}/ckpt-k", *SLOW]
    script_args = example_args(tmp_path, "k", steps=5000, dataset_size=480)
    a = nodes.start("fast-kill", SCRIPT, nnodes="1:2", extra=args, script_args=script_args)
    wait_until(lambda: "coordinator_elected" in a.log(), 60, "the first node to coordinate")
    b = nodes.start("fast-kill", SCRIPT, nnodes="1:2", extra=args, script_args=script_args)

    def both_in_one_round():
        rows = read_jsonl(trace)
        last = max((r["round"] for r in rows), default=None)
        return last is not None and {r["rank"] for r in rows if r["round"] == last} >= {0, 1}

    wait_until(both_in_one_round, 90, "both nodes training in one round")
    rows = read_jsonl(trace)
    kill_round = max(r["round"] for r in rows)
    survivor_pids = set(b.tree()) & {r["pid"] for r in rows}
    assert len(survivor_pids) == 1, survivor_pids
    t0 = time.monotonic()
    a.signal(signal.SIGKILL)

    def after():
        return [r for r in read_jsonl(trace) if r["round"] > kill_round]

    # Old code: the survivor waits for the dead coordinator's lease (20 s), then the last call.
    wait_until(after, 12, lambda: "a step in a round after the kill; survivor log tail:\n"
               + b.log()[-2500:])
    took = time.monotonic() - t0
    assert {r["pid"] for r in after()} == survivor_pids, "the survivor's worker was restarted"
    log = b.log()
    assert "coordinator_unseated" in log and "peer_proven_dead" in log, log[-3000:]
    assert "proven dead (probe refused)" in log
    assert took < 12.0


PIPELINE = str(ROOT / "tests" / "workers" / "seeded_pipeline.py")


@pytest.mark.timeout(240)
def test_agent_only_kill_takes_the_workers_tree_down_and_is_reported_lost(nodes, tmp_path):
    """`kill -9 -- -PGID` of one node's agent only (its workers run DataLoader worker
    processes): the node's whole process tree is gone within 1 s (not at the DataLoader
    workers' own 5 s parent check), the survivor trains at the new size, and the job's
    history holds a `lost` event for the killed node."""
    import json
    import os

    from elasticd.cli import main
    from elasticd.process import pid_alive

    trace = tmp_path / "trace-p.jsonl"
    args = ["--checkpoint-url", f"file://{tmp_path}/ckpt-p", "--no-warm-start"]
    script_args = ["--steps", "100000", "--dataset-size", "960", "--num-workers", "2",
                   "--step-sleep", "0.02", "--checkpoint-every", "20", "--trace", str(trace),
                   "--final-params", str(tmp_path / "final-p.pt")]
    a = nodes.start("agent-kill", PIPELINE, nnodes="1:2", extra=args, script_args=script_args,
                    name="n0")
    b = nodes.start("agent-kill", PIPELINE, nnodes="1:2", extra=args, script_args=script_args,
                    name="n1")

    def loader_workers_up():
        rows = read_jsonl(trace)
        # Both ranks training together, and the victim's worker has forked its loaders.
        return (len([r for r in rows if r["world_size"] == 2]) >= 6
                and len(a.tree()) >= 4)  # agent, worker, 2 DataLoader workers

    wait_until(loader_workers_up, 150, lambda: "both nodes training with DataLoader workers")
    victims = [p for p in a.tree() if p != a.pid]
    os.killpg(a.pid, signal.SIGKILL)  # the agent's group only: `kill -9 -- -PGID`
    t0 = time.monotonic()
    wait_until(lambda: not [p for p in victims if pid_alive(p)], 1.0,
               lambda: f"the killed node's worker tree still alive: "
                       f"{[p for p in victims if pid_alive(p)]}")
    gone_s = time.monotonic() - t0
    before = len(read_jsonl(trace))
    wait_until(lambda: [r for r in read_jsonl(trace)[before:] if r["world_size"] == 1], 90,
               lambda: "a step at world 1 after the kill:\n" + b.log()[-2500:])

    def lost_event():
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["status", "--job", "agent-kill", "--etcd", nodes.etcd.endpoint, "--json",
                  "--events", "50"])
        events = json.loads(out.getvalue()).get("events", [])
        return [e for e in events if e["kind"] == "lost" and e["node"] == "n0"]

    wait_until(lost_event, 30, lambda: "a lost event for n0:\n" + b.log()[-2500:])
    assert gone_s < 1.0
