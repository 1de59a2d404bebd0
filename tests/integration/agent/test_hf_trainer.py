"""End to end: a Hugging Face Trainer under elasticd trains every sample of every epoch once.

``ElasticTrainer`` (elasticd.integrations.transformers) on real agents, one multi-phase job
with the exactly-once matrix's fault schedule and ledger audit (the helpers are imported
from test_exactly_once_matrix): two nodes train, one is SIGKILLed mid-epoch (world size 1),
a new node joins mid-epoch (world size 2), that node is drained mid-epoch (SIGTERM to its
agent), and the survivor finishes. The Trainer takes the restart path (no live
re-formation), so every change restarts the workers from elasticd's newest checkpoint.
The global batch is constant (8: one micro-batch of 4 per rank at world size 2, two
micro-steps of 4 at world size 1), so the final parameters equal a fault-free run's.
Also: examples/hf_trainer_elastic.py under ``elasticd run --standalone --nproc-per-node 2``.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter

import pytest
import torch
from harness import PY, ROOT, read_jsonl
from integration.agent.test_exactly_once_matrix import _ledger, assert_once, kill_join_drain

pytest.importorskip("transformers", reason="the hf extra: pip install 'elasticd[hf]'")

SCRIPT = str(ROOT / "tests" / "workers" / "hf_trainer_once.py")
DATASET, EPOCHS = 48, 3  # global batch 8: 6 steps per epoch at any world size
KILL_AT, JOIN_AT, DRAIN_AT = 3, 8, 13  # epoch 0, epoch 1, epoch 2 (a stop lands a step or two on)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # a tiny model: torch's thread pool only contends


@pytest.mark.timeout(600)  # ~6 worker starts, each importing transformers: 465 s at load 25 on 2 cores
def test_trainer_kill_join_drain_trains_every_sample_once(nodes, tmp_path):
    """A 2-node ElasticTrainer job loses a node (SIGKILL), gains one and drains one, each
    mid-epoch, and still trains every sample of every epoch exactly once, ending with the
    parameters of a fault-free run at world size 1 (constant global batch)."""
    hold, trace = tmp_path / "hold", tmp_path / "trace-run.jsonl"
    args = ["--dataset-size", str(DATASET), "--epochs", str(EPOCHS), "--hold", str(hold),
            "--trace", str(trace), "--checkpoint-url", f"file://{tmp_path}/ckpt-run",
            "--output-dir", str(tmp_path / "out-run"), "--final-params", str(tmp_path / "final-run.pt")]
    # The fault-free reference runs beside the job (it shares nothing with it but the CPUs):
    # run after it, it added its own transformers import and training to the test's wall.
    ref_trace = tmp_path / "trace-ref.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    with open(tmp_path / "ref.log", "wb") as ref_log:
        ref = subprocess.Popen([PY, SCRIPT, "--dataset-size", str(DATASET), "--epochs", str(EPOCHS),
                                "--trace", str(ref_trace), "--checkpoint-url", f"file://{tmp_path}/ckpt-ref",
                                "--output-dir", str(tmp_path / "out-ref"),
                                "--final-params", str(tmp_path / "final-ref.pt")],
                               cwd=str(ROOT), env={**env, **ONE_THREAD}, stdout=ref_log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            kill_join_drain(nodes, "hf", SCRIPT, args, hold, trace, (KILL_AT, JOIN_AT, DRAIN_AT),
                            env=ONE_THREAD, wait_s=180)
            code = ref.wait(timeout=180)
        finally:
            if ref.poll() is None:
                ref.kill()
                ref.wait(10)
    assert code == 0, (tmp_path / "ref.log").read_text(errors="replace")[-4000:]

    got = _ledger(trace)
    every = Counter((e, i) for e in range(EPOCHS) for i in range(DATASET))
    assert _ledger(ref_trace) == every
    assert_once(got, every)
    assert {r["world_size"] for r in read_jsonl(trace)} == {1, 2}
    want = torch.load(tmp_path / "final-ref.pt", weights_only=True)
    got_params = torch.load(tmp_path / "final-run.pt", weights_only=True)
    for name, value in want.items():
        assert torch.allclose(value, got_params[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.timeout(300)
def test_example_runs_under_elasticd_run_standalone(tmp_path):
    """examples/hf_trainer_elastic.py under ``elasticd run --standalone --nproc-per-node 2``
    trains to the end (exit 0) and commits elasticd's checkpoint of its last step."""
    ckpt = tmp_path / "ckpt"
    run = subprocess.run(
        [PY, "-m", "elasticd.cli", "run", "--standalone", "--no-warm-start", "--log-format", "json",
         "--nproc-per-node", "2", "--checkpoint-url", f"file://{ckpt}",
         str(ROOT / "examples" / "hf_trainer_elastic.py"), "--epochs", "1", "--dataset-size", "32",
         "--output-dir", str(tmp_path / "out")],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, **ONE_THREAD, "STATE_DIRECTORY": str(tmp_path / "state")})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    manifests = sorted(p.parent.parent.name for p in ckpt.rglob("manifest.json"))
    assert manifests and manifests[-1] == "step-000000000001", manifests  # 32 / 16 = 2 steps
