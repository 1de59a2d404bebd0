"""End to end: live re-formation's fallback (issue 14), with real agents, etcd, signals.

The in-place paths (kill, join: same worker processes, the parameters of a fault-free
run, every sample once, the joiner's state from a peer) are pinned by
``test_determinism.py`` (the example uses ``LiveState``); a drain by its drain test. Here
in-place re-formation is made to fail and the agent must fall back to the restart path
and say why.
"""

from __future__ import annotations

import os
import signal

import pytest
from harness import ROOT, agent_events, end_job, event_time, example_args, read_jsonl, wait_until

SCRIPT = str(ROOT / "examples" / "train.py")
pytestmark = pytest.mark.timeout(240)


def _args(tmp_path, tag, *extra):
    return ["--checkpoint-url", f"file://{tmp_path}/ckpt-{tag}", *extra]


def _steps(trace_path):
    return {r["step"] for r in read_jsonl(trace_path)}


def test_a_failed_reformation_falls_back_to_the_restart_path_and_says_why(nodes, tmp_path):
    """The survivor's worker is frozen when its peer node is killed: in place cannot
    complete, so after ``live_reform_timeout_s`` its agent restarts the worker from the
    newest checkpoint (one log line says why) within ``plain_stop_s`` of giving up (not
    torch's 30 s for a SIGTERM the frozen worker cannot act on), and the job still trains
    every step."""
    trace, end = tmp_path / "trace-f.jsonl", tmp_path / "end-f"
    script = [*example_args(tmp_path, "f", steps=100_000, dataset_size=480), "--end-file", str(end)]
    b = [nodes.start("live-f", SCRIPT, nnodes="1:2", extra=_args(tmp_path, "f", "--live-reform-timeout", "3"),
                     script_args=script) for _ in range(2)]
    # Both ranks past step 8: the two nodes train together (a node alone at the start
    # trains at world size 1 until the other joins).
    wait_until(lambda: {r["rank"] for r in read_jsonl(trace) if r["step"] >= 8} >= {0, 1}, 120,
               "step 8 at world 2")
    pids_before = {r["pid"] for r in read_jsonl(trace)}
    frozen = set(b[0].tree()) & pids_before
    assert len(frozen) == 1, frozen
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    b[1].signal(signal.SIGKILL)
    wait_until(lambda: {r["pid"] for r in read_jsonl(trace)} - pids_before, 120,
               "a new worker training after the fallback")
    steps = end_job(end, trace)  # the job ends on the test's word once that is seen
    assert b[0].wait(150) == 0, b[0].log()[-3000:]
    log = b[0].log()
    assert "live_reform_fell_back" in log and "did not re-form within the bound" in log
    fell_back = event_time(agent_events(log, "live_reform_fell_back")[0])
    next_round = min(t for t in map(event_time, agent_events(log, "rendezvous_completed")) if t > fell_back)
    assert next_round - fell_back < 15, f"the stuck worker was stopped {next_round - fell_back:.1f}s after the fallback"
    rows = read_jsonl(trace)
    assert sorted({r["step"] for r in rows}) == list(range(steps))
    assert {r["pid"] for r in rows if r["step"] == steps - 1}.isdisjoint(frozen), "the frozen worker was not replaced"
