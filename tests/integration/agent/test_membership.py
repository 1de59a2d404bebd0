"""Membership changes with real agents, as one job: a refused duplicate id, a joining node,
SIGSTOP and SIGKILL."""

from __future__ import annotations

import signal

import pytest
from harness import ROOT, read_jsonl, wait_until

SCRIPT = str(ROOT / "tests" / "workers" / "allreduce.py")
# One job of four phases; a join takes ~30 s of agent and standby start-up at load 25 on the
# 2-core machine (over 60 s seen at load 35), hence the join's deadline.
pytestmark = pytest.mark.timeout(300)


def _steps_at(out, world):
    return [r for r in read_jsonl(out) if r["world"] == world]


def _env(out, steps=100000):
    return {"OUT": str(out), "STEPS": str(steps), "STEP_S": "0.05"}


def _after(out, at: int, world: int) -> list[dict]:
    """Rows at ``world`` written after the first ``at`` rows of the trace."""
    return [r for r in read_jsonl(out)[at:] if r["world"] == world]


def test_a_duplicate_id_is_refused_a_joiner_admitted_and_a_freeze_and_a_kill_leave_the_rest_training(
        nodes, tmp_path):
    """One job, three phases: an agent with a live node's id exits 78 naming the id and the
    fix (before it imports torch), while a node started beside it is admitted (world size 3, never 4) and the job
    trains on; a node frozen (SIGSTOP) leaves and the other two train on at world size 2;
    a member SIGKILLed leaves the last one training alone; no fault spends a restart budget."""
    out = tmp_path / "steps.jsonl"

    def start(name: str, node_id: str | None = None):
        return nodes.start("j1", SCRIPT, env=_env(out), name=name, nnodes="1:4",
                           extra=["--max-restarts", "0", "--node-id", node_id or name])

    a, b = start("a"), start("b")
    wait_until(lambda: len(_steps_at(out, 2)) >= 6, 120, "steps at world size 2")

    # Started together: the refusal and the join overlap (each costs an agent's start-up).
    second, c = start("a-again", node_id="a"), start("c")
    assert second.wait(90) == 78, second.log()[-3000:]
    assert "node id 'a' is already used by a live elasticd agent" in second.log()
    assert "two agents on one host need --node-id a / --node-id b" in second.log()
    assert "HOST-PID" not in second.log()
    # Refused before the agent imported torch (elasticd.agent.boot): no agent started.
    assert "agent_started" not in second.log(), second.log()[-3000:]
    at = len(read_jsonl(out))
    wait_until(lambda: len(_after(out, at, 3)) >= 6, 150, "steps at world size 3 after the join")
    assert not _steps_at(out, 4), "the refused agent's node was admitted (world size 4)"

    at = len(read_jsonl(out))
    c.signal(signal.SIGSTOP)
    wait_until(lambda: len(_after(out, at, 2)) >= 6, 60, "steps at world size 2 after the freeze")
    assert a.alive() and b.alive(), "a survivor exited: the freeze spent its restart budget"

    at = len(read_jsonl(out))
    b.signal(signal.SIGKILL)
    wait_until(lambda: len(_after(out, at, 1)) >= 4, 60, "steps at world size 1 after the kill")
    assert a.alive(), "the survivor exited: the kill spent its restart budget"
    c.signal(signal.SIGCONT)
