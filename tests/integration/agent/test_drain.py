"""Graceful drain with real agents: SIGTERM, second SIGTERM, grace period, stop agreement,
and drain-on-join (a node joining a running job)."""

from __future__ import annotations

import signal

import pytest
from harness import ROOT, read_jsonl, rows_after, wait_until

SCRIPT = str(ROOT / "tests" / "workers" / "drainable.py")
pytestmark = pytest.mark.timeout(150)


def _env(tmp_path, **extra):
    # Every job here ends on the test's signal (a drain, a stop after the grace), never on
    # its step count: 1,000 steps (50 s) once had to outlast a join and a drain at load 35.
    return {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"),
            "STEP_S": "0.05", "STEPS": "1000000", **extra}


def _assert_resumed_at_the_next_step(out, old_world: int, new_world: int) -> None:
    """Every rank stopped after the same step at ``old_world`` and training went on at
    ``new_world`` with exactly the next step (nothing lost, nothing trained twice)."""
    rows = read_jsonl(out)
    last_old = max(r["step"] for r in rows if r["world"] == old_world)
    first_new = min(r["step"] for r in rows_after(rows, old_world, new_world))
    assert first_new == last_old + 1, f"resumed at {first_new} at world {new_world}, last trained {last_old}"
    per_rank_last = {r["rank"]: r["step"] for r in rows if r["world"] == old_world}
    assert len(set(per_rank_last.values())) == 1, f"ranks stopped at different steps: {per_rank_last}"


def test_worker_ignoring_stop_is_stopped_after_grace(nodes, tmp_path):
    """A worker that never checks should_stop is stopped hard once the grace period ends."""
    env = _env(tmp_path, IGNORE_STOP="1")
    a = nodes.start("d2", SCRIPT, env=env, nnodes="1", extra=["--drain-grace", "2"])
    wait_until(lambda: len(read_jsonl(tmp_path / "steps.jsonl")) >= 3, 60, "first steps")
    a.signal_agent(signal.SIGTERM)
    assert a.wait(30) == 0
    assert "drain grace period over" in a.log()


def test_second_sigterm_stops_hard(nodes, tmp_path):
    """A second SIGTERM during a drain stops the workers at once."""
    env = _env(tmp_path, IGNORE_STOP="1")
    a = nodes.start("d3", SCRIPT, env=env, nnodes="1", extra=["--drain-grace", "120"])
    wait_until(lambda: len(read_jsonl(tmp_path / "steps.jsonl")) >= 3, 60, "first steps")
    a.signal_agent(signal.SIGTERM)
    wait_until(lambda: "drain_started" in a.log(), 10, "drain start")
    a.signal_agent(signal.SIGTERM)
    assert a.wait(20) == 0
    assert "second stop signal" in a.log()


def test_join_then_sigterm_drain_lose_no_step(nodes, tmp_path):
    """One job, two phases. A third node joins a 2-node job: the members stop after the
    same step and save (drain-on-join), and the job resumes at world 3 at exactly the next
    step; periodic checkpoints are off, so a restart that killed the workers would lose
    every step. Then SIGTERM to one agent: every node stops after the same step, the
    drained agent exits 0, and the others resume at exactly the next step at world 2."""
    env = _env(tmp_path, CKPT_EVERY="100000")
    out = tmp_path / "steps.jsonl"
    a = nodes.start("d4", SCRIPT, env=env, nnodes="1:3")
    b = nodes.start("d4", SCRIPT, env=env, nnodes="1:3")
    # Deadlines sized for agents that start in 35 s at a load of 35 (each wait polls).
    wait_until(lambda: len([r for r in read_jsonl(out) if r["world"] == 2]) >= 10, 120, "world 2 steps")
    c = nodes.start("d4", SCRIPT, env=env, nnodes="1:3")
    wait_until(lambda: len([r for r in read_jsonl(out) if r["world"] == 3]) >= 6, 120, "steps at world 3")
    _assert_resumed_at_the_next_step(out, 2, 3)
    assert "resize_started" in a.log() + b.log(), "the members never started a resize"
    assert a.alive() and b.alive()
    a.signal_agent(signal.SIGTERM)
    assert a.wait(60) == 0, a.log()[-3000:]
    wait_until(lambda: rows_after(read_jsonl(out), 3, 2), 60, "steps at world 2 after the drain")
    _assert_resumed_at_the_next_step(out, 3, 2)
    assert b.alive() and c.alive()
    for n in (b, c):
        n.signal_agent(signal.SIGTERM)
    for n in (b, c):
        assert n.wait(60) == 0, n.log()[-3000:]


def test_sigterm_while_waiting_for_a_round_exits_at_once(nodes, tmp_path):
    """An agent still waiting for its first round (too few nodes) that gets SIGTERM leaves
    within seconds with exit 0 and revokes its lease (no node record left behind); it used
    to sit in the rendezvous until join_timeout."""
    from elasticd.etcd.client import EtcdClient
    from elasticd.keys import JobKeys

    a = nodes.start("w1", SCRIPT, env=_env(tmp_path), nnodes="2")
    wait_until(lambda: "1/2 nodes joined" in a.log(), 60, "the agent waiting for a second node")
    a.signal_agent(signal.SIGTERM)
    assert a.wait(15) == 0, a.log()[-3000:]
    assert "stopped_while_waiting" in a.log()
    client = EtcdClient(nodes.etcd.endpoint, timeout_s=2.0)
    try:
        assert client.get(JobKeys("w1").node("n0")) is None, "the lease was not revoked"
    finally:
        client.close()
