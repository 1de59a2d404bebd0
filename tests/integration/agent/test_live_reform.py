"""End to end: live re-formation (issue 14) through real agents, etcd, gloo workers, signals.

The example trains in float64 on 3 nodes; one node is SIGKILLed. The survivors re-form in
place: their worker processes are the same before and after, the final parameters equal a
fault-free run on 2 nodes (rtol 1e-9: only the reduction order differs), and every sample
is trained exactly once. A second test makes in-place re-formation fail and checks that
the agent falls back to the restart path and says why.
"""

from __future__ import annotations

import signal
from collections import Counter

import pytest
import torch
from harness import ROOT, example_args, read_jsonl, trained_samples, wait_until

SCRIPT = str(ROOT / "examples" / "train.py")
pytestmark = pytest.mark.timeout(240)
STEPS = 120


def _args(tmp_path, tag, *extra):
    return ["--checkpoint-url", f"file://{tmp_path}/ckpt-{tag}", *extra]


def _steps(trace_path):
    return {r["step"] for r in read_jsonl(trace_path)}


def _reference(nodes, tmp_path):
    ref = [nodes.start("live-a", SCRIPT, nnodes="2", extra=_args(tmp_path, "a"),
                       script_args=example_args(tmp_path, "a", steps=STEPS, dataset_size=480))
           for _ in range(2)]
    for n in ref:
        assert n.wait(180) == 0, n.log()[-3000:]
    return torch.load(tmp_path / "final-a.pt", weights_only=True)


def test_kill_reforms_in_place_with_the_same_workers_and_the_same_result(nodes, tmp_path):
    """SIGKILL of 1 of 3 nodes: survivors keep their worker processes, lose no completed
    step, and end with the parameters and samples of a fault-free 2-node run."""
    a_params = _reference(nodes, tmp_path)
    trace = tmp_path / "trace-b.jsonl"
    b = [nodes.start("live-b", SCRIPT, nnodes="2:3", extra=_args(tmp_path, "b"),
                     script_args=example_args(tmp_path, "b", steps=STEPS, dataset_size=480))
         for _ in range(3)]
    wait_until(lambda: max(_steps(trace), default=-1) >= 17, 120, "step 17 at world 3")
    victim_pids = set(b[2].tree())
    b[2].signal(signal.SIGKILL)
    rows = read_jsonl(trace)
    round_at_kill = max(r["round"] or 0 for r in rows)
    before = {r["pid"] for r in rows if r["pid"] not in victim_pids}
    for n in b[:2]:
        assert n.wait(180) == 0, n.log()[-3000:]

    rows = read_jsonl(trace)
    after = [r for r in rows if (r["round"] or 0) > round_at_kill]
    assert after, "no step trained after the kill"
    assert {r["pid"] for r in after} <= before, "a survivor's worker was restarted"
    assert not any("live_reform_fell_back" in n.log() for n in b[:2])
    # No completed step is lost: every step is trained, the ones after the kill exactly once.
    assert sorted({r["step"] for r in rows}) == list(range(STEPS))
    assert max(Counter((r["step"], r["rank"]) for r in after).values()) == 1
    b_params = torch.load(tmp_path / "final-b.pt", weights_only=True)
    for name, value in a_params.items():
        assert torch.allclose(value, b_params[name], rtol=1e-9, atol=1e-12), name
    assert trained_samples(tmp_path / "trace-a.jsonl") == trained_samples(trace)


def test_a_failed_reformation_falls_back_to_the_restart_path_and_says_why(nodes, tmp_path):
    """One survivor's worker is frozen while a peer is killed: in place cannot complete,
    so after ``live_reform_timeout_s`` the agents restart their workers from the newest
    checkpoint (one log line says why) and the job still trains every step."""
    trace = tmp_path / "trace-f.jsonl"
    args = example_args(tmp_path, "f", steps=60, dataset_size=480)
    b = [nodes.start("live-f", SCRIPT, nnodes="2:3", extra=_args(tmp_path, "f", "--live-reform-timeout", "4"),
                     script_args=args) for _ in range(3)]
    wait_until(lambda: max(_steps(trace), default=-1) >= 12, 120, "step 12 at world 3")
    frozen = set(b[1].tree()) & {r["pid"] for r in read_jsonl(trace)}
    assert len(frozen) == 1, frozen
    for pid in frozen:
        import os

        os.kill(pid, signal.SIGSTOP)
    b[2].signal(signal.SIGKILL)
    for n in b[:2]:
        assert n.wait(180) == 0, n.log()[-3000:]
    logs = b[0].log() + b[1].log()
    assert "live_reform_fell_back" in logs and "did not re-form within the bound" in logs
    rows = read_jsonl(trace)
    assert sorted({r["step"] for r in rows}) == list(range(60))
    assert {r["pid"] for r in rows if r["step"] == 59}.isdisjoint(frozen), "the frozen worker was not replaced"
