"""examples/fsdp_train.py --dcp (the torchrun + DCP baseline of benchmarks/recovery.py) resumes
a checkpoint written at another world size where it stopped, as elasticd's checkpoints do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "fsdp_train.py"
pytestmark = pytest.mark.timeout(240)


def _torchrun(tmp_path: Path, nproc: int, *args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         str(SCRIPT), "--dcp", "--dtype", "float64", "--checkpoint-every", "5",
         "--checkpoint-url", f"file://{tmp_path / 'ckpt'}", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_a_dcp_checkpoint_of_two_ranks_resumes_at_one_rank_where_it_stopped(tmp_path):
    first = _torchrun(tmp_path, 2, "--steps", "12")
    assert [r["step"] for r in first if "loss" in r] == list(range(12))
    assert (tmp_path / "ckpt" / "step-000000011" / ".metadata").exists()
    second = _torchrun(tmp_path, 1, "--steps", "16")
    loaded = [r for r in second if r.get("event") == "checkpoint_loaded"]
    assert [r["step"] for r in loaded] == [11], second
    steps = [r for r in second if "loss" in r]
    assert [r["step"] for r in steps] == [12, 13, 14, 15]
    assert {r["world_size"] for r in steps} == {1}
    # The sampler went on from the saved position: no sample trained twice or skipped.
    assert [r["samples_trained"] for r in steps] == [64 * s for s in range(13, 17)]
