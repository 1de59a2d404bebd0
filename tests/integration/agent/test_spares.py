"""Hot spares (issue 24 item 2): agents beyond ``max`` wait registered as spares, shown
as ``spare`` in status, never failing the job or timing out; a member killed with a
spare waiting is replaced in the next round, back at full size."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest
from harness import ROOT, agent_events, read_jsonl, wait_until

from elasticd.keys import JobKeys
from elasticd.records import NodeRecord, RoundState

SCRIPT = str(ROOT / "tests" / "workers" / "plain_ddp.py")
pytestmark = pytest.mark.timeout(180)


def _records(etcd_client, keys: JobKeys) -> dict[str, NodeRecord]:
    kvs, _ = etcd_client.get_prefix(keys.nodes_prefix)
    return {kv.key.rsplit("/", 1)[-1]: NodeRecord.from_json(kv.value) for kv in kvs}


def _round(etcd_client, keys: JobKeys) -> RoundState | None:
    kv = etcd_client.get(keys.rdzv_state)
    return RoundState.from_json(kv.value) if kv is not None else None


def _spare_waiting_since(log: str) -> float:
    """Wall-clock time of the agent's first ``spare_waiting`` event."""
    events = agent_events(log, "spare_waiting")
    assert events, f"no spare_waiting event in the spare's log:\n{log[-3000:]}"
    return datetime.fromisoformat(events[0]["timestamp"].replace("Z", "+00:00")).timestamp()


def test_spare_waits_past_join_timeout_and_replaces_a_killed_member(nodes, etcd_client, tmp_path):
    """Three agents, --nnodes 1:2, --join-timeout 4: two train, the third is `spare` (in
    its record and in `elasticd status --json`) and outlives its join timeout; SIGKILL of
    a member -> the next round has the spare in it, at world 2 again; nobody failed."""
    job, keys = "spares", JobKeys("spares")
    env = {"SNAPSHOT": str(tmp_path / "snap.pt"), "OUT": str(tmp_path / "out.jsonl"),
           "EPOCHS": "1000", "EPOCH_S": "0.2"}
    kw = {"nnodes": "1:2", "extra": ["--restart-backoff", "0.1", "--join-timeout", "4"]}
    started = {n: nodes.start(job, SCRIPT, env=env, name=n, **kw) for n in ("n0", "n1", "n2")}
    out = tmp_path / "out.jsonl"
    wait_until(lambda: any(r["world"] == 2 for r in read_jsonl(out)), 90, "world 2 trains")

    def spare() -> str | None:
        recs = _records(etcd_client, keys)
        return next((n for n, r in recs.items() if r.state == "spare"), None)

    wait_until(spare, 30, lambda: f"a spare among {_records(etcd_client, keys)}")
    name = spare()
    assert name is not None
    state = _round(etcd_client, keys)
    assert state is not None and name not in state.members and len(state.members) == 2
    proc = subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", nodes.etcd.endpoint,
                           "--job", job, "--json", "--timeout", "3"], capture_output=True,
                          text=True, timeout=30)
    doc = json.loads(proc.stdout)
    shown = {n["node"]: n["state"] for n in doc["nodes"]}
    assert shown[name] == "spare" and doc["job"]["state"] == "training", doc
    # Past its join timeout (4 s) the spare still waits: a spare's deadline restarts. It has
    # waited since its `spare_waiting` line, usually long enough by now.
    since = _spare_waiting_since(started[name].log())
    wait_until(lambda: time.time() - since > 5 or not started[name].alive(), 10,
               "the spare's join timeout to pass")
    assert started[name].alive(), started[name].log()[-3000:]
    assert all(node.alive() for node in started.values())

    victim = state.members[-1]
    started[victim].signal(signal.SIGKILL)
    started[victim].wait(10)
    old_round = state.round
    wait_until(lambda: (s := _round(etcd_client, keys)) is not None and s.round > old_round
               and s.phase == "final" and name in s.members and len(s.members) == 2, 30,
               lambda: f"the spare admitted: {_round(etcd_client, keys)}")
    rows = len(read_jsonl(out))
    wait_until(lambda: len(read_jsonl(out)) >= rows + 2, 60, "training on after the kill")
    assert read_jsonl(out)[-1]["world"] == 2
    assert _records(etcd_client, keys)[name].state != "spare"
    assert '"spare_admitted"' in started[name].log()
    survivors = [n for n in started.values() if n is not started[victim]]
    assert all(n.alive() for n in survivors), [n.log()[-2000:] for n in survivors]
