"""`elasticd status` for an ElasticLoop job (the DDP tutorial): samples/s is measured, not 0.0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from harness import ROOT, wait_until

PROBE = str(ROOT / "tests" / "workers" / "tutorial_probe.py")
pytestmark = pytest.mark.timeout(180)


def _progress(endpoint: str, job: str) -> dict | None:
    proc = subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", endpoint, "--job", job,
                           "--json", "--timeout", "3"], capture_output=True, text=True, timeout=30)
    try:
        return json.loads(proc.stdout).get("progress")
    except ValueError:
        return None


def test_elastic_loop_job_reports_samples_per_second(nodes, tmp_path):
    """Two agents train examples/ddp_tutorial_elastic.py (ElasticLoop): status --json shows
    samples_trained growing and samples_per_s > 0 while it trains."""
    # The job trains until the test ends it (the fixture kills the nodes), not for a step
    # count chosen to outlast status's first measured rate.
    env = {"TUTORIAL": "ddp_tutorial_elastic.py", "TRACE": str(tmp_path / "trace.jsonl"),
           "WORKDIR": str(tmp_path), "STEP_S": "0.05", "EPOCHS": "100000", "BATCH": "4",
           "DATASET": "64"}
    a, b = (nodes.start("loop-rate", PROBE, nnodes="2:2", env=env, name=n) for n in ("a", "b"))
    seen: list[dict | None] = []

    def rate() -> dict | None:
        p = _progress(nodes.etcd.endpoint, "loop-rate")
        seen[:] = [p]
        return p if p and p["samples_per_s"] and p["samples_per_s"] > 0 else None

    p = wait_until(rate, 90, lambda: f"samples_per_s > 0; last progress: {seen}; "
                                      f"log: {a.log()[-1500:]}")
    # 2 ranks x 4 samples a step: the job-wide count, not one rank's share of one epoch.
    assert p["samples_trained"] >= 8 and p["samples_trained"] % 8 == 0, p


@pytest.mark.timeout(150)
def test_status_shows_the_auto_checkpoint_interval(nodes, tmp_path):
    """An agent with --checkpoint-every auto and two ElasticLoop ranks: after the first save
    (50 steps) has measured its cost, status --json shows the Young–Daly interval the ranks
    agreed on, with its reason (measured blocking and write time, MTBF from the ledger's
    losses), and the table shows the cadence row."""
    env = {"TUTORIAL": "ddp_tutorial_elastic.py", "TRACE": str(tmp_path / "trace.jsonl"),
           "WORKDIR": str(tmp_path), "STEP_S": "0.01", "EPOCHS": "1000", "BATCH": "4",
           "DATASET": "800"}
    node = nodes.start("loop-auto", PROBE, nnodes="1:1", nproc=2, env=env,
                       extra=["--checkpoint-every", "auto"])
    seen: list[dict | None] = []

    def measured() -> dict | None:
        p = _progress(nodes.etcd.endpoint, "loop-auto")
        seen[:] = [p]
        cadence = (p or {}).get("checkpoint_cadence")
        return cadence if cadence and "MTBF" in cadence["reason"] else None

    cadence = wait_until(measured, 120, lambda: f"a measured cadence in status; last progress: "
                                                 f"{seen}; log: {node.log()[-1500:]}")
    assert cadence["every_steps"] >= 1 and cadence["interval_s"] > 0, cadence
    assert "blocking" in cadence["reason"] and "0 loss(es)" in cadence["reason"], cadence
    table = subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", nodes.etcd.endpoint,
                            "--job", "loop-auto", "--timeout", "3"], capture_output=True, text=True,
                           timeout=30, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "cadence" in table and "auto: every" in table, table
