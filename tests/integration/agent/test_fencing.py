"""Zombies: a node frozen past its TTL comes back after the job moved on (issue: fencing)."""

from __future__ import annotations

import json
import signal
import time

import pytest
from harness import ROOT, read_jsonl, wait_until

from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys

SCRIPT = str(ROOT / "tests" / "workers" / "allreduce.py")
pytestmark = pytest.mark.timeout(180)


def _env(out):
    return {"OUT": str(out), "STEPS": "100000", "STEP_S": "0.05"}


def _events(etcd, job):
    c = EtcdClient(etcd.endpoint)
    try:
        kvs, _ = c.get_prefix(JobKeys(job).events_prefix)
        return [json.loads(kv.value) for kv in kvs]
    finally:
        c.close()


@pytest.mark.parametrize("freeze", ["node", "agent"])
def test_frozen_node_rejoins_as_new_member(nodes, tmp_path, freeze):
    """A node (or only its agent: a partition) frozen past its TTL: the others go on at
    world 2, and after SIGCONT the zombie rejoins at a later round at world 3."""
    out = tmp_path / "steps.jsonl"
    ns = [nodes.start("z1", SCRIPT, env=_env(out), nnodes="2:3", extra=["--max-restarts", "0"])
          for _ in range(3)]
    wait_until(lambda: len([r for r in read_jsonl(out) if r["world"] == 3]) >= 6, 60, "world 3")
    zombie = ns[2]
    stop = zombie.signal if freeze == "node" else zombie.signal_agent
    stop(signal.SIGSTOP)
    t_freeze = time.time()
    wait_until(lambda: len([r for r in read_jsonl(out) if r["world"] == 2 and r["time"] > t_freeze]) >= 6,
               60, "world 2 without the frozen node")
    stop(signal.SIGCONT)
    t_wake = time.time()
    wait_until(lambda: len([r for r in read_jsonl(out) if r["world"] == 3 and r["time"] > t_wake]) >= 6,
               90, "world 3 after the zombie rejoined")
    events = _events(nodes.etcd, "z1")
    lost = [e for e in events if e["kind"] == "lease_lost" and e["node"] == "n2"]
    assert lost, f"no lease_lost event for the zombie: {[e['kind'] for e in events]}"
    assert all(n.alive() for n in ns)
