"""Membership changes with real agents: SIGKILL, SIGSTOP and a joining node."""

from __future__ import annotations

import signal

import pytest
from harness import ROOT, read_jsonl, wait_until

SCRIPT = str(ROOT / "tests" / "workers" / "allreduce.py")
pytestmark = pytest.mark.timeout(150)


def _steps_at(out, world):
    return [r for r in read_jsonl(out) if r["world"] == world]


def _env(out, steps=100000):
    return {"OUT": str(out), "STEPS": str(steps), "STEP_S": "0.05"}


def test_a_frozen_node_leaves_and_the_others_train_on_at_world_two(nodes, tmp_path):
    """A node frozen (SIGSTOP) mid-training: the other two train on at world size 2,
    without spending their restart budget."""
    out = tmp_path / "steps.jsonl"
    ns = [nodes.start("j1", SCRIPT, env=_env(out), extra=["--max-restarts", "0"]) for _ in range(3)]
    wait_until(lambda: len(_steps_at(out, 3)) >= 6, 60, "steps at world size 3")
    ns[2].signal(signal.SIGSTOP)
    wait_until(lambda: len(_steps_at(out, 2)) >= 6, 60, "steps at world size 2 after the fault")
    assert ns[0].alive() and ns[1].alive(), "a survivor exited: the fault spent its restart budget"
    ns[2].signal(signal.SIGCONT)


def test_a_joining_node_is_admitted_and_once_killed_the_others_train_on(nodes, tmp_path):
    """One job, two phases: a node started while a 2-node job trains is admitted at the
    next round (world size 3); then a member SIGKILLed, the other two train on at world
    size 2 without spending their restart budget."""
    out = tmp_path / "steps.jsonl"
    ns = [nodes.start("j2", SCRIPT, env=_env(out), extra=["--max-restarts", "0"]) for _ in range(2)]
    wait_until(lambda: len(_steps_at(out, 2)) >= 6, 60, "steps at world size 2")
    ns.append(nodes.start("j2", SCRIPT, env=_env(out), extra=["--max-restarts", "0"]))
    wait_until(lambda: len(_steps_at(out, 3)) >= 6, 60, "steps at world size 3 after the join")
    at_three = len(read_jsonl(out))
    ns[1].signal(signal.SIGKILL)
    wait_until(lambda: sum(1 for r in read_jsonl(out)[at_three:] if r["world"] == 2) >= 6, 60,
               "steps at world size 2 after the kill")
    assert ns[0].alive() and ns[2].alive(), "a survivor exited: the kill spent its restart budget"


def test_second_agent_with_the_same_node_id_is_refused(nodes, tmp_path):
    """Two agents configured with one node id on one host: the second exits 78 naming the
    id and the fix, and the first keeps training untouched."""
    out = tmp_path / "steps.jsonl"
    first = nodes.start("j3", SCRIPT, env=_env(out), nnodes="1:2", name="a", extra=["--node-id", "same"])
    wait_until(lambda: len(_steps_at(out, 1)) >= 4, 60, "the first agent training")
    second = nodes.start("j3", SCRIPT, env=_env(out), nnodes="1:2", name="b", extra=["--node-id", "same"])
    assert second.wait(60) == 78, second.log()[-3000:]
    assert "node id 'same' is already used by a live elasticd agent" in second.log()
    assert "two agents on one host need --node-id a / --node-id b" in second.log()
    assert "HOST-PID" not in second.log()
    before = len(_steps_at(out, 1))
    wait_until(lambda: len(_steps_at(out, 1)) >= before + 4, 30, "the first agent still training")
    assert first.alive() and not _steps_at(out, 2)
