"""The agents keep the job's bounded history, and `status --plot` draws a real job."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys

import pytest
from harness import ROOT, read_jsonl, wait_until

from elasticd.etcd.client import EtcdClient
from elasticd.history import History
from elasticd.keys import JobKeys

SCRIPT = str(ROOT / "tests" / "workers" / "drainable.py")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_agent_appends_history_that_status_plots(nodes, tmp_path):
    """A training agent appends progress samples to /elasticd/<job>/history; --plot draws them."""
    env = {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"),
           "STEP_S": "0.05"}
    a = nodes.start("hist", SCRIPT, env=env, nnodes="1")
    wait_until(lambda: read_jsonl(tmp_path / "steps.jsonl"), 60, "first steps")
    client = EtcdClient(nodes.etcd.endpoint, timeout_s=3)
    try:
        def sampled():
            kv = client.get(JobKeys("hist").history)
            return History.from_json(kv.value) if kv else None

        # The first published progress is the first sample (when a sample is due after
        # that is pinned by tests/unit/test_history.py).
        history = wait_until(sampled, 40, "a history sample", interval_s=0.2)
    finally:
        client.close()
    first = history.samples[0]
    assert first.world_size == 1 and first.round >= 0 and first.step >= 0
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib (the [plot] extra) is not installed: --plot not exercised here")
    else:
        png = tmp_path / "hist.png"
        proc = subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", nodes.etcd.endpoint,
                               "--job", "hist", "--plot", str(png)], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    a.signal_agent(signal.SIGTERM)
    assert a.wait(60) == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_agent_survives_a_deeply_nested_history_record(nodes, tmp_path):
    """'[' * 100000 + ']' * 100000 at /elasticd/<job>/history does not crash the rank-0 agent:
    it replaces the record with a valid one, keeps training and drains to exit 0 (issue 21)."""
    keys = JobKeys("deep")
    client = EtcdClient(nodes.etcd.endpoint, timeout_s=3)
    try:
        client.put(keys.history, b"[" * 100_000 + b"]" * 100_000)
        env = {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"),
               "STEP_S": "0.05"}
        a = nodes.start("deep", SCRIPT, env=env, nnodes="1")

        def replaced():
            kv = client.get(keys.history)
            try:
                return History.from_json(kv.value).samples if kv else None
            except (ValueError, RecursionError):  # RecursionError: the old reader, in this test
                return None

        wait_until(lambda: replaced() or not a.alive(), 60, "the history record to be replaced",
                   interval_s=0.2)
        assert a.alive(), a.log()[-3000:]
        assert "RecursionError" not in a.log()
    finally:
        client.close()
    a.signal_agent(signal.SIGTERM)
    assert a.wait(60) == 0, a.log()[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_status_goodput_charges_a_worker_kill_and_matches_the_step_audit(nodes, tmp_path):
    """A real job whose worker is SIGKILLed: `status --goodput --json` charges the restart
    (recovery, retrained steps) and its trained share agrees with an audit from the workers'
    own step times over the same span, within what the history's 5 s resolution allows."""
    out = tmp_path / "steps.jsonl"
    env = {"OUT": str(out), "CKPT": str(tmp_path / "ckpt.json"), "STEP_S": "0.05",
           "CKPT_EVERY": "20"}
    a = nodes.start("goodput", SCRIPT, env=env, nnodes="1")
    client = EtcdClient(nodes.etcd.endpoint, timeout_s=3)

    def samples() -> int:
        kv = client.get(JobKeys("goodput").history)
        return len(History.from_json(kv.value).samples) if kv else 0

    try:
        wait_until(lambda: samples() >= 2, 60, "two history samples", interval_s=0.2)
        handed = [json.loads(line)["pid"] for line in a.log().splitlines()
                  if line.startswith("{") and '"standby_handed_over"' in line]
        assert handed, a.log()[-3000:]
        worker = handed[-1]  # the worker training now
        killed_at = len(read_jsonl(out))
        os.killpg(worker, signal.SIGKILL)
        wait_until(lambda: len(read_jsonl(out)) > killed_at + 60, 60, "training after the kill")
        n = samples()
        wait_until(lambda: samples() >= n + 1, 60, "a sample after the restart", interval_s=0.2)
        proc = subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", nodes.etcd.endpoint,
                               "--job", "goodput", "--goodput", "--json"], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        history = History.from_json(client.get(JobKeys("goodput").history).value)
    finally:
        client.close()
    life = doc["life"]
    assert doc["schema"] == "elasticd.goodput/v1"
    causes = life["by_cause"]
    assert causes["recovery"]["worker_seconds"] + causes["retrained"]["worker_seconds"] > 0
    assert sum(c["share"] for c in causes.values()) == pytest.approx(1.0, abs=1e-3)
    # The audit: new steps trained inside the ledger's span, at the workers' median step
    # time, over the span (one worker).
    rows = [r for r in read_jsonl(out) if history.samples[0].t < r["time"] <= history.samples[-1].t]
    times = sorted(r["time"] for r in read_jsonl(out))
    step_s = statistics.median(b - t for t, b in zip(times, times[1:], strict=False))
    seen: set[int] = set()
    new = 0
    for r in rows:
        new += r["step"] not in seen and r["step"] > max(seen, default=-1)
        seen.add(r["step"])
    audit = new * step_s / (history.samples[-1].t - history.samples[0].t)
    print(f"ledger goodput {life['goodput']:.3f}, audit {audit:.3f}, {len(history.samples)} samples")
    assert life["goodput"] == pytest.approx(audit, abs=0.05), (life, audit)
    # An operator's `kill -USR1 <agent>`: every agent thread's stack in its log, and on it goes.
    a.signal_agent(signal.SIGUSR1)
    wait_until(lambda: "most recent call first" in a.log(), 10, "the agent's thread stacks")
    assert a.alive()
    a.signal_agent(signal.SIGTERM)
    assert a.wait(60) == 0
