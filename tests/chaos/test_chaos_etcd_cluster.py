"""Chaos on the control plane: a seeded sequence of etcd member faults under a training job.

Two agents train (tests/workers/allreduce.py, no checkpoint commits) against a 3-member
etcd while members are killed (down longer than the node TTL), frozen (longer than the
election timeout, shorter than two thirds of the TTL: see deployment.md on etcd#15247),
stopped and restarted, or handed leadership. Faults hit the member an agent talks to, and
a quorum is always kept. No worker may restart, no step may repeat, no lease may be lost.

``make test`` runs one short seed; ELASTICD_SOAK=1 runs more faults. On failure the seed
and the fault log are printed; pin a seed with ELASTICD_CHAOS_SEED.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from harness import ROOT, Node, elasticd_argv, read_jsonl, wait_until

SOAK = os.environ.get("ELASTICD_SOAK") == "1"
pytestmark = pytest.mark.timeout(600 if SOAK else 150)
SCRIPT = str(ROOT / "tests" / "workers" / "allreduce.py")
TTL_S = 3
FAULTS = ("kill", "freeze", "restart", "move_leader")


def test_training_survives_seeded_etcd_member_faults(etcd_cluster, tmp_path):
    """A seeded run of member kills, freezes, restarts and leader moves: the job keeps its
    round and its worker processes, and every rank's steps stay contiguous."""
    seed = int(os.environ.get("ELASTICD_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    count = 20 if SOAK else 4
    out = tmp_path / "steps.jsonl"
    env = {"OUT": str(out), "STEPS": "1000000", "STEP_S": "0.05"}
    nodes = [Node(elasticd_argv(etcd_cluster.endpoints, "chaos-etcd", SCRIPT, nnodes="2",
                                node_id=f"n{i}", extra=["--node-ttl", str(TTL_S), "--max-restarts", "0"]),
                  env, tmp_path / f"n{i}.log") for i in range(2)]
    done: list[str] = []
    try:
        wait_until(lambda: len(read_jsonl(out)) >= 20, 90, "the first steps")
        for _ in range(count):
            fault, agent = rng.choice(FAULTS), rng.choice(nodes)
            used = [i for i in etcd_cluster.members_used_by(agent.pid) if etcd_cluster.members[i].running]
            target = used[0] if used else rng.randrange(3)
            done.append(f"{fault} m{target} (used by {agent.argv[agent.argv.index('--node-id') + 1]})")
            if fault == "kill":
                etcd_cluster.kill(target)
                time.sleep(TTL_S + 1)  # longer than the TTL: a stuck client would lose its lease
                etcd_cluster.restart(target)
            elif fault == "freeze":
                etcd_cluster.move_leader(target)
                etcd_cluster.freeze(target)
                time.sleep(1.5)
                etcd_cluster.resume(target)
            elif fault == "restart":
                etcd_cluster.stop_member(target)
                etcd_cluster.restart(target)
            else:
                etcd_cluster.move_leader(target)
            etcd_cluster.wait_leader()
            steps = len(read_jsonl(out))
            wait_until(lambda s=steps: len(read_jsonl(out)) >= s + 10, 30, f"steps after {done[-1]}")
        rows = read_jsonl(out)
        report = f"seed {seed}; faults: {done}"
        assert len({r["pid"] for r in rows}) == 2, f"workers restarted ({report})"
        for rank in (0, 1):
            steps = [r["step"] for r in rows if r["rank"] == rank]
            assert steps == list(range(len(steps))), f"rank {rank} repeated a step ({report})"
        for n in nodes:
            assert n.alive(), f"{report}\n{n.log()[-3000:]}"
            events = {e.get("event") for e in read_jsonl(n.log_path)}
            assert "lease_lost" not in events, f"{report}\n{n.log()[-3000:]}"
    finally:
        for n in nodes:
            n.cleanup()
