"""The elastic DDP tutorial drains at a step boundary and resumes mid-epoch exactly once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "workers" / "tutorial_probe.py"
pytestmark = pytest.mark.timeout(240)  # two cold starts: 154 s seen at a load of 40
PAUSE_AT = 18  # 12 batches an epoch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path: Path, **extra: str) -> subprocess.Popen:
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "TRACE": str(tmp_path / "trace.jsonl"), "WORKDIR": str(tmp_path), **extra}
    for key in ("ELASTICD_CONTROL_DIR", "ELASTICD_CONTROL_SOCKET", "ELASTICD_CHECKPOINT_URL"):
        env.pop(key, None)
    return subprocess.Popen([sys.executable, str(PROBE)], env=env, cwd=str(ROOT),
                            stdout=open(tmp_path / "out.log", "ab"), stderr=subprocess.STDOUT)


def _rows(tmp_path: Path) -> list[dict]:
    path = tmp_path / "trace.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_drains_and_the_rerun_trains_each_sample_once_per_epoch(tmp_path):
    """SIGTERM mid-epoch 1: exit 0 after the current step with a checkpoint; the rerun
    resumes at the next batch; every (epoch, sample) is trained exactly once."""
    import time

    # The worker waits after its 18th batch (mid-epoch 1) until the SIGTERM: the signal
    # lands there, not in a race with the end of the run.
    (tmp_path / "pause").write_text(str(PAUSE_AT))
    proc = _start(tmp_path, PAUSE_FILE=str(tmp_path / "pause"))
    deadline = time.monotonic() + 90
    while len(_rows(tmp_path)) < PAUSE_AT and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, (tmp_path / "out.log").read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, (tmp_path / "out.log").read_text()[-3000:]
    drained = len(_rows(tmp_path))
    assert drained == PAUSE_AT, f"drained after {drained} steps, not after the step in flight"
    rerun = _start(tmp_path)
    assert rerun.wait(150) == 0, (tmp_path / "out.log").read_text()[-3000:]
    rows = _rows(tmp_path)
    assert len(rows) == 36, f"{len(rows)} steps trained in all, want 3 epochs x 12"
    counts = Counter((r["epoch"], i) for r in rows for i in r["idx"])
    assert counts == Counter((e, i) for e in range(3) for i in range(96))
