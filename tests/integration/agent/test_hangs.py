"""End to end: a hung node is ejected and the others train on in seconds (issue 24 item 3).

Three agents x one gloo worker of examples/train.py (live re-formation on). One node's
*worker* is SIGSTOPped while its agent stays alive: its lease never expires, so before
hang ejection the other two sat in their all-reduce until the collective timeout. Now the
coordinator sees the stopped worker in that node's beat, ejects it by opening the next
round with cause ``member_hung``; the other two re-form live at world 2 within seconds,
the ejected node's agent kills its stopped worker and rejoins cold, and every step and
every sample is trained exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter

import pytest
from harness import PY, ROOT, agent_events, example_args, read_jsonl, trained_samples, wait_until

from elasticd.process import pid_alive

SCRIPT = str(ROOT / "examples" / "train.py")
pytestmark = pytest.mark.timeout(150)
STEPS = 100
DATASET = 480  # 20 steps an epoch at a global batch of 24


def _rounds_after(rows: list[dict], round_: int, ranks: set[int]) -> set[int]:
    return {r["rank"] for r in rows if (r["round"] or 0) > round_ and r["rank"] in ranks}


def test_a_stopped_worker_is_ejected_and_the_others_train_on_in_seconds(nodes, tmp_path):
    """SIGSTOP of one node's worker (agent alive): the others train again within seconds
    at world 2 without restarting their workers, the node is named ``hung`` and rejoins,
    0 steps lost, every sample exactly once."""
    trace = tmp_path / "trace-h.jsonl"
    extra = ["--checkpoint-url", f"file://{tmp_path}/ckpt-h"]  # the default hang_eject_s
    ns = [nodes.start("hang", SCRIPT, nnodes="2:3", extra=extra,
                      script_args=example_args(tmp_path, "h", steps=STEPS, dataset_size=DATASET))
          for _ in range(3)]
    wait_until(lambda: {r["rank"] for r in read_jsonl(trace) if r["step"] >= 10
                        } >= {0, 1, 2}, 90, "step 10 at world 3")
    rows = read_jsonl(trace)
    round_at_stop = max(r["round"] or 0 for r in rows)
    victim = ns[2]
    worker = set(victim.tree()) & {r["pid"] for r in rows}
    assert len(worker) == 1, worker
    survivor_pids = {r["pid"] for r in rows} - worker
    stopped_at = time.monotonic()
    for pid in worker:
        os.kill(pid, signal.SIGSTOP)
    survivors = {r["rank"] for r in rows if r["pid"] in survivor_pids and (r["round"] or 0) == round_at_stop}
    wait_until(lambda: any((r["round"] or 0) > round_at_stop for r in read_jsonl(trace)),
               30, "the others training again after the SIGSTOP")
    back_s = time.monotonic() - stopped_at
    assert back_s < 15, f"the others trained again only {back_s:.1f}s after the SIGSTOP"
    assert survivors, rows[-3:]
    # The stopped worker was killed by its own agent (the whole process group).
    wait_until(lambda: not any(pid_alive(p) for p in worker), 20, "the stopped worker killed")
    assert victim.alive(), "the ejected node's agent exited instead of rejoining"
    for n in ns:
        assert n.wait(120) == 0, n.log()[-3000:]

    logs = [n.log() for n in ns]
    ejections = [e for text in logs for e in agent_events(text, "member_ejected")]
    assert ejections and ejections[0]["ejected"] == [f"n{2}"], ejections
    assert agent_events(logs[2], "node_ejected"), "the ejected agent did not say so"
    assert not any("live_reform_fell_back" in text for text in logs[:2]), "a survivor restarted"
    rows = read_jsonl(trace)
    after = {r["pid"] for r in rows if (r["round"] or 0) > round_at_stop and r["pid"] not in worker}
    new_pids = after - survivor_pids
    assert new_pids, "the ejected node never rejoined"
    assert sorted({r["step"] for r in rows}) == list(range(STEPS))
    want = Counter((e, i) for e in range(STEPS * 24 // DATASET) for i in range(DATASET))
    assert trained_samples(trace) == want
    # status names the node and the cause (the job's bounded event history).
    out = subprocess.run([PY, "-m", "elasticd.cli", "status", "--etcd", nodes.etcd.endpoint,
                          "--job", "hang", "--json"], capture_output=True, text=True, timeout=30,
                         cwd=str(ROOT))
    doc = json.loads(out.stdout)
    hung = [e for e in doc["events"] if e.get("kind") == "hung"]
    assert hung and "n2" in hung[0]["message"], doc["events"][-10:]
    print(f"SIGSTOP -> others train again: {back_s:.2f} s")


def test_a_worker_slowed_from_outside_is_flagged_as_a_straggler(nodes, tmp_path):
    """A SIGSTOP/SIGCONT duty cycle on one node's worker (about half its time stopped):
    the coordinator flags that node, and only it, within a few windows; status shows a
    ``straggler`` event naming it. Nobody is ejected for it."""
    trace = tmp_path / "trace-s.jsonl"
    extra = ["--checkpoint-url", f"file://{tmp_path}/ckpt-s", "--straggler-window", "5"]
    ns = [nodes.start("strag", SCRIPT, nnodes="2:3", extra=extra,
                      script_args=example_args(tmp_path, "s", steps=2000, dataset_size=DATASET))
          for _ in range(3)]
    wait_until(lambda: {r["rank"] for r in read_jsonl(trace) if r["step"] >= 10} >= {0, 1, 2}, 90,
               "step 10 at world 3")
    worker = set(ns[2].tree()) & {r["pid"] for r in read_jsonl(trace)}
    assert len(worker) == 1, worker
    pid = worker.pop()
    stop = threading.Event()

    def duty_cycle() -> None:  # fault injection, not synchronisation: 0.1 s on, 0.1 s off
        while not stop.is_set():
            for sig in (signal.SIGSTOP, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    return
                stop.wait(0.1)
        os.kill(pid, signal.SIGCONT)

    injector = threading.Thread(target=duty_cycle, daemon=True)
    slowed_at = time.monotonic()
    injector.start()
    try:
        wait_until(lambda: any(agent_events(n.log(), "stragglers_flagged") for n in ns), 40,
                   "the slowed node flagged")
        print(f"slowed -> flagged (5 s window): {time.monotonic() - slowed_at:.1f} s")
    finally:
        stop.set()
        injector.join(5)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    flagged = [e for n in ns for e in agent_events(n.log(), "stragglers_flagged")]
    assert set(flagged[0]["nodes"]) == {"n2"}, flagged
    assert not any(agent_events(n.log(), "member_ejected") for n in ns), "a straggler was ejected as hung"
    out = subprocess.run([PY, "-m", "elasticd.cli", "status", "--etcd", nodes.etcd.endpoint,
                          "--job", "strag", "--json"], capture_output=True, text=True, timeout=30,
                         cwd=str(ROOT))
    events = json.loads(out.stdout)["events"]
    assert any(e["kind"] == "straggler" and e["node"] == "n2" for e in events), events[-10:]
