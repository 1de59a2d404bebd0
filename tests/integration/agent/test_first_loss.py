"""End to end: a checkpoint that loads but trains to an infinite loss is refused, one tier down.

One agent, one gloo worker (tests/workers/first_loss_job.py; the ranks' agreement on the
verdict is pinned by test_live_transfer.py). The first attempt blows a
weight up to 1e200 (finite: every CRC and finiteness check passes) before the save of step
9, commits it and SIGKILLs itself. The agent restarts the workers; they load step 9 and the
first loss is infinite: the save is marked suspect (``suspect.json``) and the workers fail.
The next attempt skips it, loads step 4 and trains to the end, equal to a fault-free run.
Before the check, the job looped: every restart loaded step 9 and trained on NaN.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from harness import ROOT, agent_events, read_jsonl

from elasticd.checkpoint import list_checkpoints

SCRIPT = ROOT / "tests" / "workers" / "first_loss_job.py"
STEPS, SAVE_EVERY, POISON_AT = 20, 5, 9


def _script_module():
    spec = importlib.util.spec_from_file_location("first_loss_job", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(150)
def test_a_checkpoint_whose_first_loss_is_infinite_is_marked_suspect_and_the_one_before_loads(
        nodes, tmp_path: Path):
    out, final = tmp_path / "steps.jsonl", tmp_path / "final.pt"
    url = f"file://{tmp_path}/ckpt"
    env = {"OUT": str(out), "STEPS": str(STEPS), "SAVE_EVERY": str(SAVE_EVERY),
           "POISON_AT": str(POISON_AT), "FINAL": str(final)}
    node = nodes.start("firstloss", str(SCRIPT), env=env, nnodes="1", nproc=1,
                       extra=["--checkpoint-url", url, "--max-restarts", "3",
                              "--restart-backoff", "0.2"])
    assert node.wait(120) == 0, node.log()[-4000:]

    rows = read_jsonl(out)
    # Attempt 1 loaded step 9 and refused it at its first step; attempt 2 loaded step 4.
    assert sorted({r["restart"] for r in rows}) == [0, 1, 2], rows[-6:]
    refused = [r for r in rows if r["restart"] == 1]
    assert {r["step"] for r in refused} == {POISON_AT + 1}, refused
    assert any(not math.isfinite(r["loss"]) for r in refused), refused
    assert min(r["step"] for r in rows if r["restart"] == 2) == POISON_AT + 1 - SAVE_EVERY
    assert [r["step"] for r in rows if r["restart"] == 0] == list(range(POISON_AT + 1))
    # The ledger: every step's final attempt.
    last = {}
    for r in rows:
        last[(r["step"], r["rank"])] = r["restart"]
    back_to = POISON_AT + 1 - SAVE_EVERY  # the save before the refused one, + 1
    assert last == {(s, 0): 0 if s < back_to else 2 for s in range(STEPS)}, last
    assert all(math.isfinite(r["loss"]) for r in rows if r["restart"] == 2)

    # What the worker said, and what is left in storage.
    said = [json.loads(line) for line in node.log().splitlines()
            if '"restore_refused"' in line and line.startswith("{")]
    assert said and f"checkpoint step {POISON_AT}" in said[0]["restored_from"], said
    assert "inf" in said[0]["reason"], said[0]
    skipped = agent_events(node.log(), "checkpoint_skipped")
    assert skipped and "marked suspect" in skipped[0]["reason"], skipped
    assert f"step-{POISON_AT:012d}/" in skipped[0]["url"] and "suspect.json" in skipped[0]["reason"]
    # Retrained, step 9 was saved again; retention then deleted the refused copy (an older
    # copy of a step), so the listing holds only valid saves.
    assert all(i.valid for i in list_checkpoints(url, "firstloss"))

    # The run ends where a fault-free run ends.
    got = torch.load(final, weights_only=True)
    want = _script_module().reference(STEPS, 1)
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=1e-10, atol=1e-12), (k, got[k], v)
