"""`elasticd status` against real agents: start, node killed, drain, job end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import jsonschema
import pytest
from harness import ROOT, read_jsonl, wait_until

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


def test_status_follows_a_real_job(nodes, tmp_path):
    """Training at full size → 0; a node SIGKILLed → shown lost, event listed, degraded (1);
    the other drained → stopped (2)."""
    env = {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"), "STEP_S": "0.05"}
    a = nodes.start("st", SCRIPT, env=env, nnodes="1:2")
    b = nodes.start("st", SCRIPT, env=env, nnodes="1:2")
    out = tmp_path / "steps.jsonl"
    wait_until(lambda: len([r for r in read_jsonl(out) if r["world"] == 2]) >= 20, 60, "world 2")

    def healthy():
        code, doc = status(nodes.etcd, "st")
        return (code, doc) if code == 0 else None

    code, doc = wait_until(healthy, 30, "status exit 0 while training at full size")
    assert doc["job"]["state"] == "training"
    assert {n["node"] for n in doc["nodes"]} == {"n0", "n1"}

    b.signal(signal.SIGKILL)
    wait_until(lambda: [r for r in read_jsonl(out) if r["world"] == 1], 60, "world 1 after the kill")
    code, doc = status(nodes.etcd, "st")
    assert code == 1, doc
    kinds = {(e["kind"], e["node"]) for e in doc["events"]}
    assert ("lost", "n1") in kinds, kinds

    a.signal_agent(signal.SIGTERM)
    assert a.wait(60) == 0
    code, doc = status(nodes.etcd, "st")
    assert code == 2 and doc["job"]["state"] == "stopped", doc["job"]
    assert any(e["kind"] == "drain" for e in doc["events"])


def test_status_after_the_job_finished(nodes, tmp_path):
    """A job whose workers all succeeded is reported stopped (exit 2) with a finished event."""
    env = {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"),
           "STEP_S": "0.01", "STEPS": "10"}
    a = nodes.start("fin", SCRIPT, env=env, nnodes="1")
    assert a.wait(60) == 0
    code, doc = status(nodes.etcd, "fin")
    assert code == 2 and doc["job"]["state"] == "stopped", doc["job"]
    assert any(e["kind"] == "finished" for e in doc["events"])
