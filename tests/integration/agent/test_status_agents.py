"""`elasticd status` against real agents: start, node killed, drain, job end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import jsonschema
import pytest
from harness import ROOT, read_jsonl, rows_after, wait_until

from elasticd.status.jsondoc import load_schema

SCRIPT = str(ROOT / "tests" / "workers" / "drainable.py")
pytestmark = pytest.mark.timeout(180)


def status(etcd, job, *extra):
    """Run `python -m elasticd.status --json`; return (exit code, document)."""
    proc = subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", etcd.endpoint, "--job", job,
                           "--json", "--timeout", "3", *extra], capture_output=True, text=True, timeout=30)
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, load_schema())
    return proc.returncode, doc


def watch_json(etcd, job, out_path):
    """`elasticd status --watch --json` as a process: one document per change, to a file."""
    return subprocess.Popen([sys.executable, "-m", "elasticd.status", "--etcd", etcd.endpoint,
                             "--job", job, "--json", "--watch"], stdout=open(out_path, "w"),
                            stderr=subprocess.DEVNULL, start_new_session=True)


def test_status_follows_a_real_job(nodes, tmp_path):
    """Full size: exit 0, every node's beat fresh (newer than its round), its step and local
    world size shown, progress never behind the checkpoint. A node SIGKILLed (no liveness
    probe): re-forming (its peer's failure report, before the lease expires), then training at world 1,
    degraded (1). The other drained: stopped (2), its row "left", no row "lost"."""
    env = {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"), "STEP_S": "0.05"}
    # Without the liveness probe: a refused probe closes the next round ~0.1 s after the
    # kill, too fast for the watcher to catch "re-forming" between two documents (the fast
    # path has its own test, test_fast_kill.py); the lease keeps the state up for ~2 s.
    probe_off = ["--no-liveness-probe"]
    a = nodes.start("st", SCRIPT, env=env, nnodes="1:2", extra=probe_off)
    b = nodes.start("st", SCRIPT, env=env, nnodes="1:2", extra=probe_off)
    out = tmp_path / "steps.jsonl"
    wait_until(lambda: len([r for r in read_jsonl(out) if r["world"] == 2]) >= 20, 60, "world 2")
    docs = tmp_path / "watch.jsonl"
    watcher = watch_json(nodes.etcd, "st", docs)
    try:
        last: list[dict] = []

        def beating():
            code, doc = status(nodes.etcd, "st")
            last[:] = [doc]
            formed = doc["job"]["round_completed_at"]
            fresh = formed is not None and len(doc["nodes"]) == 2 and all(
                n["heartbeat_at"] is not None and n["heartbeat_at"] > formed
                and n["heartbeat_age_s"] < 10 and n["step"] is not None for n in doc["nodes"])
            # A beat newer than the round: the record alone dates from the round's start.
            return (code, doc) if code == 0 and fresh else None

        code, doc = wait_until(beating, 30, lambda: f"fresh beats at full size; last: {last}")
        assert doc["job"]["state"] == "training"
        assert {n["node"] for n in doc["nodes"]} == {"n0", "n1"}
        assert all(n["local_world_size"] == 1 for n in doc["nodes"])
        p, c = doc["progress"], doc["checkpoint"]
        if c is not None and c["round"] == p["round"]:
            assert p["step"] >= c["step"], (p, c)

        b.signal(signal.SIGKILL)
        wait_until(lambda: rows_after(read_jsonl(out), 2, 1), 60, "world 1 after the kill")
        code, doc = status(nodes.etcd, "st", "--events", "100")
        assert code == 1, doc
        kinds = {(e["kind"], e["node"]) for e in doc["events"]}
        assert ("lost", "n1") in kinds, kinds
        seen = [d["job"]["state"] for d in read_jsonl(docs) if d.get("kind") == "job"]
        assert "re-forming" in seen, seen
    finally:
        os.killpg(watcher.pid, signal.SIGKILL)
        watcher.wait(10)

    a.signal_agent(signal.SIGTERM)
    assert a.wait(60) == 0
    code, doc = status(nodes.etcd, "st")
    assert code == 2 and doc["job"]["state"] == "stopped", doc["job"]
    assert any(e["kind"] == "drain" for e in doc["events"])
    rows = {n["node"]: (n["state"], n["left"]) for n in doc["nodes"]}
    assert rows == {"n0": ("left", "drained")}, rows


def test_status_after_the_job_finished(nodes, tmp_path):
    """A job whose workers all succeeded is reported stopped (exit 2) with a finished event."""
    env = {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"),
           "STEP_S": "0.01", "STEPS": "10"}
    a = nodes.start("fin", SCRIPT, env=env, nnodes="1")
    assert a.wait(60) == 0
    code, doc = status(nodes.etcd, "fin")
    assert code == 2 and doc["job"]["state"] == "stopped", doc["job"]
    assert any(e["kind"] == "finished" for e in doc["events"])
    assert [(n["node"], n["state"], n["left"]) for n in doc["nodes"]] == [("n0", "left", "finished")]
