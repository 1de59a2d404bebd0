"""A plain torchrun-style DDP script runs under elasticd unchanged (worker API issue, item 6)."""

from __future__ import annotations

import pytest
from harness import ROOT, read_jsonl

SCRIPT = str(ROOT / "tests" / "workers" / "plain_ddp.py")


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
