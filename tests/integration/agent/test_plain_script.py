"""A plain torchrun-style DDP script runs under elasticd unchanged (worker API issue, item 6)."""

from __future__ import annotations

import signal
import time

import pytest
from harness import ROOT, read_jsonl, wait_until

from elasticd.etcd import EtcdClient
from elasticd.keys import JobKeys

SCRIPT = str(ROOT / "tests" / "workers" / "plain_ddp.py")
ALLREDUCE = str(ROOT / "tests" / "workers" / "allreduce.py")


@pytest.mark.timeout(120)
def test_plain_ddp_script_restarts_from_its_own_snapshot(nodes, tmp_path):
    """The script crashes once; elasticd restarts it and it resumes from its own snapshot."""
    out = tmp_path / "epochs.jsonl"
    env = {"SNAPSHOT": str(tmp_path / "snap.pt"), "OUT": str(out), "EPOCHS": "6", "CRASH_AT_EPOCH": "2"}
    node = nodes.start("plain", SCRIPT, env=env, nnodes="1", nproc=2,
                       extra=["--max-restarts", "1", "--restart-backoff", "0.1"])
    assert node.wait(90) == 0, node.log()[-3000:]
    rows = read_jsonl(out)
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["restart"] for r in rows] == ["0", "0", "0", "1", "1", "1"]
    assert {r["world"] for r in rows} == {2}


def _rows_at(out, world, after=0.0):
    return [r for r in read_jsonl(out) if r["world"] == world and r["time"] > after]


@pytest.mark.timeout(300)
def test_a_plain_scripts_killed_node_restarted_rejoins_within_seconds(nodes, tmp_path, etcd_server):
    """Issue 52: a plain script (no worker API, so it never registers for live
    re-formation) loses a node to SIGKILL; the node, restarted once the survivor trains on,
    is back at world 2 within seconds of its agent asking to join, not after waiting out
    live_reform_timeout_s (set long here, so that the wait cannot pass as start-up)."""
    out = tmp_path / "steps.jsonl"
    env = {"OUT": str(out), "STEPS": "1000000", "STEP_S": "0.05"}
    extra = ["--max-restarts", "0", "--live-reform-timeout", "150"]
    nodes.start("plainrejoin", ALLREDUCE, env=env, nnodes="1:2", name="a", extra=extra)
    b = nodes.start("plainrejoin", ALLREDUCE, env=env, nnodes="1:2", name="b", extra=extra)
    wait_until(lambda: len(_rows_at(out, 2)) >= 6, 90, "steps at world size 2")
    b.signal(signal.SIGKILL)
    killed_at = time.time()
    wait_until(lambda: len(_rows_at(out, 1, killed_at)) >= 6, 60, "the survivor training on alone")
    client = EtcdClient(etcd_server.endpoint, timeout_s=2.0)
    try:  # the killed agent's lease must expire before the same node id may register again
        wait_until(lambda: client.get(JobKeys("plainrejoin").node("b")) is None, 30,
                   "the killed node's record gone")
    finally:
        client.close()
    before = len(b.log())  # the restarted node appends to the same log
    again = nodes.start("plainrejoin", ALLREDUCE, env=env, nnodes="1:2", name="b", extra=extra)
    # Ready: its agent started (imports, standbys) and asks the survivor to admit it.
    wait_until(lambda: "to admit us" in again.log()[before:], 120, "the restarted node asking to join")
    ready_at = time.time()
    wait_until(lambda: len(_rows_at(out, 2, ready_at)) >= 2, 30,
               lambda: f"no world-2 step within 30 s of the restarted node asking to join:\n"
                       f"{again.log()[-3000:]}")
    first = min(r["time"] for r in _rows_at(out, 2, ready_at))
    print(f"rejoined {first - ready_at:.1f} s after the restarted node asked to join")
