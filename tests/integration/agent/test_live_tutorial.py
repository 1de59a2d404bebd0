"""End to end: the DDP tutorial with live re-formation (examples/ddp_tutorial_live.py,
``ElasticLoop(live=True)``) survives a killed node and takes in a joining one without
restarting its workers, with real agents, etcd and signals (issue 14)."""

from __future__ import annotations

import signal
from collections import Counter

import pytest
from harness import ROOT, read_jsonl, wait_until

PROBE = str(ROOT / "tests" / "workers" / "tutorial_probe.py")
EPOCHS, BATCH, DATASET = 2, 4, 480
pytestmark = pytest.mark.timeout(240)


def test_live_tutorial_keeps_its_workers_through_a_kill_and_a_join(nodes, tmp_path):
    """Node b is SIGKILLed mid-epoch: a's worker (same PID) re-forms in place and trains on
    alone; node c joins and gets the state from a (no checkpoint read); every sample of
    every epoch is trained, and at most the one step in flight at the kill twice."""
    trace, pause = tmp_path / "trace.jsonl", tmp_path / "pause"
    # The test decides when the job goes on, never a step count: each worker waits after
    # its 6th batch until the kill has landed (PAUSE_FILE), and a alone waits after each
    # batch until c's arrival re-forms it (HOLD_BELOW_WORLD).
    pause.write_text("6")
    env = {"TUTORIAL": "ddp_tutorial_live.py", "TRACE": str(trace), "WORKDIR": str(tmp_path),
           "STEP_S": "0.02", "PAUSE_FILE": str(pause), "HOLD_BELOW_WORLD": "2",
           "EPOCHS": str(EPOCHS), "BATCH": str(BATCH), "DATASET": str(DATASET)}
    a, b = (nodes.start("live-tut", PROBE, nnodes="1:2", env=env, name=n) for n in ("a", "b"))
    # The kill lands while both ranks wait after their 6th batch, each batch's row written:
    # a rank killed between its update and its row would leave samples that were trained
    # (their gradients are in a's model) but not in the ledger.
    wait_until(lambda: Counter(r["rank"] for r in read_jsonl(trace) if r["world"] == 2) == {0: 6, 1: 6},
               120, "both ranks to train 6 batches at world 2 and wait")
    a_pids = {r["pid"] for r in read_jsonl(trace) if r["world"] == 2} & set(a.tree())
    b_pids = {r["pid"] for r in read_jsonl(trace) if r["world"] == 2} & set(b.tree())
    assert len(a_pids) == 1 and len(b_pids) == 1, (a_pids, b_pids)
    b.signal(signal.SIGKILL)
    b.wait(30)
    pause.unlink()
    # Rows at world 1 come only after the kill (a alone), however fast a re-forms.
    wait_until(lambda: any(r["world"] == 1 for r in read_jsonl(trace)), 60,
               lambda: "a to train on alone: " + a.log()[-2000:])
    # a alone waits after each batch until c's arrival re-forms it: no row at world 2
    # can come before c starts.
    joined_at = len(read_jsonl(trace))
    c = nodes.start("live-tut", PROBE, nnodes="1:2", env=env, name="c")
    wait_until(lambda: any(r["world"] == 2 for r in read_jsonl(trace)[joined_at:]), 120,
               lambda: "c to join: " + c.log()[-2000:])
    assert a.wait(120) == 0, a.log()[-3000:]
    assert c.wait(60) == 0, c.log()[-3000:]

    rows = read_jsonl(trace)
    after = {r["pid"] for r in rows} - b_pids
    assert len(after) == 2 and a_pids <= after, f"a's worker was restarted: {after} vs {a_pids}"
    assert a.log().count("loop_reformed") >= 2, a.log()[-3000:]
    assert "live_state_received" in c.log() and "checkpoint_loaded" not in c.log(), c.log()[-3000:]
    counts = Counter((r["epoch"], i) for r in rows for i in r["idx"])
    want = {(e, i) for e in range(EPOCHS) for i in range(DATASET)}
    assert set(counts) == want, sorted(want - set(counts))[:10]
    twice = [k for k, n in counts.items() if n > 1]
    assert len(twice) <= BATCH * 2 and all(n <= 2 for n in counts.values()), twice
