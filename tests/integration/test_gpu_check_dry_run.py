"""benchmarks/gpu_check.py --cpu-dry-run: the GPU machine's one-shot script, run on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(150)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmd:
            found.append(int(entry))
    return found


def test_cpu_dry_run_passes_every_check_and_writes_the_json(tmp_path):
    """The dry run trains, survives a worker SIGKILL (resumes from the committed checkpoint),
    drains on SIGTERM with 0 steps lost, re-forms a group after a peer's SIGKILL and sends
    the state to a joiner, round-trips a checkpoint, exits 0, writes every
    result key to $OUT/gpu_check.json, and leaves no agent or worker behind."""
    work = tmp_path / "work"
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-dry-run",
                               "--budget-s", "85", "--workdir", str(work)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    finally:
        leftovers = _processes_mentioning(str(work))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert leftovers == [], f"processes left behind: {leftovers}"
    assert "d live re-formation [ok] (gloo, 2 rank(s))" in proc.stdout
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert results["reformation"]["joiner"]["state_equal"] is True
    assert {"mode", "environment", "throughput", "recovery", "reformation", "checkpoint",
            "sharded", "errors", "ok", "wall_s"} <= set(results)
    assert results["sharded"]["equal"] is True and results["sharded"]["dtensors"] == "DTensor"
    assert results["mode"] == "cpu-dry-run" and results["ok"] is True and results["errors"] == {}
    assert results["throughput"]["exit_code"] == 0
    kill, drain = results["recovery"]["kill"], results["recovery"]["drain"]
    # The resume uses the newest save the fence accepted before the new worker started (a
    # save whose manifest was written but whose commit the kill cut off does not count).
    assert kill["resumed_from"] >= kill["committed_before_restart"] >= kill["committed_at_kill"]
    assert kill["first_new_step_s"] is not None and kill["steps_lost"] >= 0
    assert drain["exit_code"] == 0 and drain["steps_lost"] == 0
    ck = results["checkpoint"]
    assert ck["equal"] is True and ck["loaded_step"] == 2 and len(ck["saves"]) == 2
    assert {"save_blocked_s", "copy_done_s", "copy_gb_per_s", "committed_s"} <= set(ck["saves"][-1])
