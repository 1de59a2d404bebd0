"""The agents keep the job's bounded history, and `status --plot` draws a real job."""

from __future__ import annotations

import importlib.util
import signal
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
