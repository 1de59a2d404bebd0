"""Quarantine of a node whose replicas diverge again: three real agents, live re-formation,
one node's rank corrupted repeatedly; it is put on probation, drained, and admitted again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import ROOT, agent_events, event_time, wait_until

from elasticd.cli import main

SCRIPT = str(ROOT / "tests" / "workers" / "diverging.py")
PROBATION_S = 6


def _events(endpoint: str, job: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", endpoint, "--job", job,
                          "--json", "--events", "256", "--timeout", "3"], capture_output=True,
                         text=True, timeout=60)
    try:
        return json.loads(out.stdout)["events"]
    except (ValueError, KeyError):
        return []


@pytest.mark.soak  # 152 s at a load of 28 on 2 cores: make soak; the rule is pinned in tests/unit
@pytest.mark.timeout(300)
def test_a_node_that_diverges_twice_is_quarantined_and_readmitted(nodes, tmp_path):
    """Node n2's rank diverges every 10 steps (restored from the majority each time): its
    second divergence quarantines it (a `quarantined` event on n2 after two `diverged`
    events naming its rank), its agent drains it and it waits as a spare on probation while
    n0 and n1 train on; after the probation it is admitted again; no other node diverged."""
    env = {"CKPT": f"file://{tmp_path}/ckpt", "PYTHONPATH": str(ROOT)}
    extra = ["--straggler-probation", str(PROBATION_S)]
    ns = [nodes.start("quar", SCRIPT, nnodes="2:3", extra=extra, name=f"n{i}",
                      env={**env, "NUDGE": "1"} if i == 2 else env) for i in range(3)]
    ep = nodes.etcd.endpoint
    seen: list[list[dict]] = [[]]

    def quarantined() -> dict | None:
        seen[0] = _events(ep, "quar")
        return next((e for e in seen[0] if e["kind"] == "quarantined"), None)

    q = wait_until(quarantined, 180, lambda: f"a quarantine; events: {seen[0][-8:]}; "
                                             f"n2 log: {ns[2].log()[-2000:]}")
    assert q["node"] == "n2" and q["detail"]["probation_s"] == PROBATION_S, q
    before = [e for e in seen[0] if e["seq"] < q["seq"]]
    diverged = [e for e in before if e["kind"] == "diverged"]
    assert len(diverged) >= 2 and {e["node"] for e in diverged} == {"n2"}, diverged
    assert agent_events(ns[2].log(), "node_quarantined"), ns[2].log()[-2000:]

    # Drained (not killed), then admitted again no earlier than its probation's end (its
    # standby slow to import under load may ask to join only after that: no spare wait then).
    quarantined_at = event_time(agent_events(ns[2].log(), "node_quarantined")[0])

    def back() -> dict | None:
        log = ns[2].log()
        if not agent_events(log, "straggler_drain_started"):
            return None
        return next((e for e in agent_events(log, "rendezvous_completed")
                     if event_time(e) > quarantined_at and e["round"] > q["round"]), None)

    again = wait_until(back, 120, lambda: f"n2 drained and admitted again; n2 log: "
                                          f"{ns[2].log()[-3000:]}")
    assert event_time(again) >= quarantined_at + PROBATION_S, "admitted again while on probation"
    assert main(["stop", "--job", "quar", "--etcd", ep, "--wait", "0"]) == 0
    for n in ns:
        assert n.wait(120) == 0, n.log()[-3000:]
    assert not any(e["kind"] == "diverged" and e["node"] != "n2" for e in _events(ep, "quar"))
