"""End to end: a Lightning ``Trainer`` with ``ElasticCallback`` under real agents.

One multi-phase job on the restart path (Lightning's process group cannot re-form in place):
two nodes train, one is SIGKILLed mid-epoch 0 (world size 1, two micro-batches per step), a
new node joins in epoch 1 (world size 2, one each), that node is drained (SIGTERM to its
agent) in epoch 2, and the survivor trains to the end. The pace and the ledger audit are
the worker API's (tests/integration/agent/test_exactly_once_matrix.py): every sample of
every epoch trained exactly once, and with the constant global batch the same final
parameters as a fault-free run. The examples' own run under ``elasticd run --standalone``
is the second test.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from harness import PY, ROOT, Node, read_jsonl
from integration.agent.test_exactly_once_matrix import _ledger, assert_once, kill_join_drain

from elasticd.checkpoint.catalog import list_checkpoints

pytest.importorskip("lightning", reason="the Lightning integration's tests need elasticd[lightning]")

SCRIPT = str(ROOT / "tests" / "workers" / "lightning_once.py")
EXAMPLE = str(ROOT / "examples" / "lightning_elastic.py")
DATASET, EPOCHS = 96, 3  # 6 steps of 16 samples per epoch at any world size
KILL_AT, JOIN_AT, DRAIN_AT = 3, 8, 14  # epoch 0, 1 and 2
pytestmark = pytest.mark.timeout(600)  # a loaded 2-core CI box: ~6 Lightning imports per job


def _reference(tmp_path: Path) -> tuple[Counter, dict]:
    trace = tmp_path / "trace-ref.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    run = subprocess.run([PY, SCRIPT, "--dataset-size", str(DATASET), "--epochs", str(EPOCHS),
                          "--trace", str(trace), "--checkpoint-url", f"file://{tmp_path}/ckpt-ref",
                          "--final-params", str(tmp_path / "final-ref.pt")],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return _ledger(trace), torch.load(tmp_path / "final-ref.pt", weights_only=True)


def test_lightning_kill_join_drain_trains_every_sample_once(nodes, tmp_path):
    """A Lightning job on two agents loses a node (SIGKILL), gains one (join) and drains one
    (SIGTERM to its agent), each mid-epoch, and still trains every sample of every epoch
    exactly once, ending with the fault-free run's parameters (constant global batch)."""
    hold, trace = tmp_path / "hold", tmp_path / "trace-run.jsonl"
    args = ["--dataset-size", str(DATASET), "--epochs", str(EPOCHS), "--hold", str(hold),
            "--trace", str(trace), "--checkpoint-url", f"file://{tmp_path}/ckpt-run",
            "--final-params", str(tmp_path / "final-run.pt")]
    kill_join_drain(nodes, "lit", SCRIPT, args, hold, trace, (KILL_AT, JOIN_AT, DRAIN_AT))

    got = _ledger(trace)
    want, want_params = _reference(tmp_path)
    every = Counter((e, i) for e in range(EPOCHS) for i in range(DATASET))
    assert want == every, f"fault-free run: {sorted((want - every) + (every - want))[:10]}"
    assert_once(got, every)
    assert {r["world_size"] for r in read_jsonl(trace)} == {1, 2}
    got_params = torch.load(tmp_path / "final-run.pt", weights_only=True)
    for name, value in want_params.items():
        assert torch.allclose(value, got_params[name], rtol=1e-9, atol=1e-12), name


def test_the_example_trains_under_elasticd_run_standalone(tmp_path):
    """examples/lightning_elastic.py under ``elasticd run --standalone --nproc-per-node 2``
    trains every epoch at world size 2 and commits its last step through the agent's fence."""
    url = f"file://{tmp_path}/checkpoints"
    # 256 samples, a global batch of 2 x 32: 4 steps per epoch, 2 epochs.
    argv = [PY, "-m", "elasticd.cli", "run", "--standalone", "--nproc-per-node", "2",
            "--log-format", "json", "--no-warm-start", "--workdir", str(tmp_path),
            "--checkpoint-url", url, EXAMPLE, "--epochs", "2", "--dataset-size", "256"]
    node = Node(argv, {"STATE_DIRECTORY": str(tmp_path / "state")}, tmp_path / "example.log")
    try:
        assert node.wait(240) == 0, node.log()[-3000:]
        saved = [c for c in list_checkpoints(url) if c.valid]
        assert saved and max(c.step for c in saved) == 2 * 4 - 1, saved
        assert {c.world_size for c in saved} == {2}, saved
    finally:
        node.cleanup()
