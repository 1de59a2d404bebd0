"""Worker failures with real agents: restart budget, summary, non-retryable, hangs, kill -9."""

from __future__ import annotations

import json
import os
import signal

import pytest
from harness import ROOT, read_jsonl, wait_until

from elasticd.process import wait_gone

SCRIPT = str(ROOT / "tests" / "workers" / "drainable.py")
pytestmark = pytest.mark.timeout(120)


def _env(tmp_path, **extra):
    return {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"),
            "STEP_S": "0.02", **extra}


def test_worker_crash_is_restarted_within_budget(nodes, tmp_path):
    """A worker exiting 3 at step 5 is restarted (restart count 1) and the job finishes."""
    a = nodes.start("f1", SCRIPT, env=_env(tmp_path, STEPS="15", EXIT_CODE_AT="5:3"), nnodes="1",
                    extra=["--max-restarts", "2", "--restart-backoff", "0.1"])
    assert a.wait(90) == 0, a.log()[-3000:]
    rows = read_jsonl(tmp_path / "steps.jsonl")
    assert max(r["restart"] for r in rows) == 1
    assert max(r["step"] for r in rows) == 14


def test_budget_exhausted_prints_summary(nodes, tmp_path):
    """With no restarts left, the agent exits non-zero naming the failed rank and exit code."""
    a = nodes.start("f2", SCRIPT, env=_env(tmp_path, EXIT_CODE_AT="2:7"), nnodes="1",
                    extra=["--max-restarts", "0"])
    assert a.wait(90) == 1
    log = a.log()
    assert "giving up" in log and "rank 0" in log and "exit code 7" in log, log[-3000:]


def test_exit_code_2_on_first_start_is_not_retried(nodes, tmp_path):
    """Exit code 2 before any step (argument parsing) ends the agent without retrying."""
    bad = tmp_path / "badargs.py"
    bad.write_text("import argparse\nargparse.ArgumentParser().parse_args(['--nope'])\n")
    a = nodes.start("f3", str(bad), nnodes="1", extra=["--max-restarts", "5"])
    assert a.wait(60) == 1
    assert "exit code 2 on the first start" in a.log()


def test_missing_script_is_a_config_error(nodes, tmp_path):
    """A script that does not exist exits 78 with a message naming the path."""
    a = nodes.start("f4", str(tmp_path / "nope.py"), nnodes="1")
    assert a.wait(30) == 78
    assert "does not exist" in a.log()


def test_hung_worker_is_restarted(nodes, tmp_path):
    """A rank that stops making progress is restarted after hang_timeout, with a stack dump."""
    a = nodes.start("f5", SCRIPT, env=_env(tmp_path, STEPS="12", HANG_AT="4"), nnodes="1",
                    extra=["--hang-timeout", "2", "--max-restarts", "1", "--restart-backoff", "0.1"])
    assert a.wait(90) == 0, a.log()[-3000:]
    rows = read_jsonl(tmp_path / "steps.jsonl")
    assert max(r["restart"] for r in rows) == 1
    log = a.log()
    assert "workers hung" in log
    assert "Thread 0x" in log or "Current thread" in log, "no faulthandler stack dump in the log"


def test_kill_9_of_agent_leaves_no_worker(nodes, tmp_path):
    """SIGKILL of the agent alone: its workers die with it (PR_SET_PDEATHSIG)."""
    a = nodes.start("f6", SCRIPT, env=_env(tmp_path), nnodes="1", nproc=2)
    wait_until(lambda: len(read_jsonl(tmp_path / "steps.jsonl")) >= 4, 60, "first steps")
    workers = [p for p in a.tree() if p != a.pid]
    assert workers
    a.signal_agent(signal.SIGKILL)
    assert wait_gone(workers, 10) == [], "workers outlived the agent"


def _events(node, name: str) -> list[dict]:
    out = []
    for line in node.log().splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return [e for e in out if e.get("event") == name]


def test_restarted_workers_come_from_warm_standbys(nodes, tmp_path):
    """Standbys start with the agent and become the first workers; once the group trains,
    new ones wait with torch imported, and after a worker is killed they become the new
    workers (their pids, the right ranks). No standby outlives the agent."""
    a = nodes.start("f7", SCRIPT, env=_env(tmp_path, STEP_S="0.05"), nnodes="1", nproc=2,
                    extra=["--max-restarts", "2", "--restart-backoff", "0.1"], standby_refill=True)
    wait_until(lambda: len(_events(a, "standby_started")) >= 4, 60, "first workers' and next standbys")
    handed = [e["pid"] for e in _events(a, "standby_handed_over")]
    waiting = [e["pid"] for e in _events(a, "standby_started") if e["pid"] not in handed]
    assert len(handed) == 2 and len(waiting) == 2, a.log()[-3000:]
    # The first two started before the agent imported torch, at the normal priority.
    first = _events(a, "standby_started")[:2]
    assert [(e.get("early"), e.get("urgent"), e["pid"] in handed) for e in first] == [(True, True, True)] * 2
    assert not _events(a, "standby_not_used"), "an early standby's environment did not match"
    assert set(handed + waiting) <= set(a.tree())
    os.killpg(handed[0], signal.SIGKILL)
    wait_until(lambda: {r["rank"] for r in read_jsonl(tmp_path / "steps.jsonl") if r["restart"] == 1} == {0, 1},
               60, "both ranks training after the restart")
    assert sorted(e["pid"] for e in _events(a, "standby_handed_over")[2:]) == sorted(waiting)
    rows = [r for r in read_jsonl(tmp_path / "steps.jsonl") if r["restart"] == 1]
    assert {r["world"] for r in rows} == {2}
    wait_until(lambda: len(_events(a, "standby_started")) >= 6, 60, "standbys refilled")
    tree = a.tree()
    a.signal_agent(signal.SIGTERM)
    assert a.wait(60) == 0, a.log()[-3000:]
    assert wait_gone(tree, 10) == [], "a worker or standby outlived the agent"


def test_no_warm_start_starts_no_standby(nodes, tmp_path):
    """--no-warm-start: every worker starts cold, no standby process appears."""
    a = nodes.start("f8", SCRIPT, env=_env(tmp_path, STEPS="60"), nnodes="1",
                    extra=["--no-warm-start"])
    assert a.wait(90) == 0, a.log()[-3000:]
    assert "standby_started" not in a.log()


def test_a_script_that_fails_at_import_gives_up_after_one_retry(nodes, tmp_path):
    """The same exception at import on every attempt: one retry, then exit 1 with the line plain."""
    bad = tmp_path / "badimport.py"
    bad.write_text("import nosuchmodule_elasticd_test\n")
    a = nodes.start("f8", str(bad), nnodes="1", extra=["--restart-backoff", "0.1"])
    assert a.wait(90) == 1, a.log()[-3000:]
    rows = [json.loads(line) for line in a.log().splitlines() if line.startswith("{")]
    raised = [r for r in rows if r.get("event") == "worker_output" and r.get("local_rank") == 0
              and r["line"].endswith("No module named 'nosuchmodule_elasticd_test'")]
    assert len(raised) == 2, [r.get("line") for r in raised]  # two attempts, not four
    summary = [r for r in rows if r.get("event") == "failure_summary"]
    assert len(summary) == 1
    assert "all 2 attempts failed the same way before their first step" in summary[0]["message"]
    assert summary[0]["error"] == "ModuleNotFoundError: No module named 'nosuchmodule_elasticd_test'"
    assert '"py_callstack"' not in summary[0]["message"]


def test_a_killed_worker_of_a_live_job_spends_the_budget(nodes, tmp_path):
    """examples/train.py (live re-formation on), 2 workers on one node, no restarts allowed:
    a worker SIGKILLed ends the job non-zero, whichever the agent sees first, the dead
    worker or its local peer's failed collective (which starts a live re-formation into a
    round with the same nodes). A fresh-clone suite once saw the second order restart the
    group as a membership change, outside the budget (a worker crashing at the same step
    every time would then loop forever)."""
    a = nodes.start("f9", str(ROOT / "examples" / "train.py"), nnodes="1", nproc=2,
                    extra=["--max-restarts", "0", "--checkpoint-url", f"file://{tmp_path / 'ckpt'}"],
                    script_args=["--steps", "100000", "--step-sleep", "0.01"])
    wait_until(lambda: a.log().count('"checkpoint_committed"') >= 2, 90, "two checkpoints committed")
    workers = [e["pid"] for e in _events(a, "standby_handed_over")]  # warm standbys run the script
    assert len(workers) == 2, a.log()[-3000:]
    os.kill(workers[0], signal.SIGKILL)
    assert a.wait(60) == 1, a.log()[-3000:]
    assert "restart budget is spent" in a.log(), a.log()[-3000:]

