"""Replica fingerprints in a live 3-rank gloo DDP job and a live 6-rank HSDP job (3 replicas
of 2 shards; real worker processes): a weight nudged once on one rank is found within one
fingerprint interval, the event names the rank, and the ranks end equal (to a fault-free
run when found at the step it happened)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elasticd.etcd.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "workers" / "fingerprinted.py"
HSDP_SCRIPT = ROOT / "tests" / "workers" / "hsdp_fingerprinted.py"
EVERY = 5


def _start(out: Path, extra: dict[str, str], script: Path = SCRIPT, world: int = 3,
           per_node: int = 1) -> list[subprocess.Popen]:
    out.mkdir()
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OUT": str(out),
               "CKPT": f"file://{out}/ckpt", "FP_EVERY": str(EVERY), "PYTHONPATH": str(ROOT),
               "ELASTICD_CONTROL_DIR": str(out / f"cd{rank}"), **extra}
        (out / f"cd{rank}").mkdir()
        for key in ("ELASTICD_CONTROL_SOCKET", "ELASTICD_ROUND", "ELASTICD_LIVE"):
            env.pop(key, None)
        with open(out / f"log{rank}", "w") as log_file:  # the child keeps its own copy
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                          stdout=log_file, stderr=subprocess.STDOUT))
    return procs


def _finish(procs: list[subprocess.Popen], out: Path,
            deadline: float) -> tuple[list[dict], list[dict]]:
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join((out / f"log{r}").read_text() for r in range(len(procs)))
    assert [p.returncode for p in procs] == [0] * len(procs), logs
    return ([json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))],
            [torch.load(out / f"rank{r}.pt") for r in range(len(procs))])


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(480)
def test_a_nudged_replica_is_found_within_one_interval_and_restored(tmp_path):
    """Rank 1's weight nudged by 1e-3 once: every rank's fingerprints name rank 1 within one
    interval, and all ranks end bit-equal; found at the step it happened, they equal a
    fault-free run's parameters."""
    runs = {"clean": {}, "aligned": {"NUDGE_RANK": "1", "NUDGE_STEP": str(2 * EVERY)},
            "late": {"NUDGE_RANK": "1", "NUDGE_STEP": str(2 * EVERY + 2)}}
    procs = {name: _start(tmp_path / name, extra) for name, extra in runs.items()}
    deadline = time.monotonic() + 420  # imports of 9 torch processes on a loaded machine
    results = {name: _finish(p, tmp_path / name, deadline) for name, p in procs.items()}

    reports, clean = results["clean"]
    assert all(r["diverged"] == [] for r in reports), reports
    assert all(_equal(s, clean[0]) for s in clean)

    for name, nudge in (("aligned", 2 * EVERY), ("late", 2 * EVERY + 2)):
        reports, states = results[name]
        for r in reports:
            assert r["diverged"] == [[1]], (name, reports)
            assert nudge <= r["found_at"] < nudge + EVERY, (name, reports)
        assert all(_equal(s, states[0]) for s in states), f"{name}: ranks ended different"
        log1 = (tmp_path / name / "log0").read_text()
        assert "replica_diverged" in log1 and "ranks=[1]" in log1, log1[-2000:]
    assert _equal(results["aligned"][1][0], clean[0]), "restored state differs from fault-free"
    assert not _equal(results["late"][1][0], clean[0])  # two steps of rank 1's gradients


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(600)
def test_a_nudged_hsdp_replica_is_found_within_one_interval_and_restored_from_its_shard(tmp_path):
    """HSDP, 3 replicas x 2 shards: rank 3's local shard (shard 1) nudged once is named
    (rank 3 alone) within one interval, restored from a replica of shard 1, and every
    rank's local shards (parameters and Adam state) end equal to a fault-free run's."""
    nudge = 2 * EVERY
    runs = {"clean": {}, "nudged": {"NUDGE_RANK": "3", "NUDGE_STEP": str(nudge)}}
    procs = {name: _start(tmp_path / name, extra, HSDP_SCRIPT, world=6, per_node=2)
             for name, extra in runs.items()}
    deadline = time.monotonic() + 540  # imports of 12 torch processes: 440 s at a load of 37
    results = {name: _finish(p, tmp_path / name, deadline) for name, p in procs.items()}

    reports, clean = results["clean"]
    assert all(r["diverged"] == [] and r["steps_done"] == 20 for r in reports), reports
    assert [r["shard"] for r in reports] == [0, 1, 0, 1, 0, 1], reports
    assert _same(clean[1], clean[3]) and _same(clean[0], clean[2]) and not _same(clean[0], clean[1])

    reports, states = results["nudged"]
    for r in reports:
        assert r["diverged"] == [[3]], reports
        assert nudge <= r["found_at"] < nudge + EVERY, reports
    for rank in range(6):
        assert _same(states[rank], clean[rank]), f"rank {rank} ended unlike the fault-free run"
    log = (tmp_path / "nudged" / "log1").read_text()
    assert "replica_diverged" in log and "ranks=[3]" in log and "replica_restored" in log, log[-2000:]


def _status(endpoint: str, job: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", endpoint, "--job", job,
                           "--timeout", "3", *flags], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.timeout(240)
def test_a_divergence_under_an_agent_is_an_event_naming_the_rank_and_node(nodes, tmp_path):
    """One agent, three ranks, rank 1 nudged once: the job restores it and finishes, and
    `elasticd status` (table and --json) shows a `diverged` event naming rank 1 and the node."""
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "CKPT": f"file://{out}/ckpt", "FP_EVERY": str(EVERY),
           "NUDGE_RANK": "1", "NUDGE_STEP": str(2 * EVERY), "PYTHONPATH": str(ROOT)}
    node = nodes.start("diverge", str(SCRIPT), nnodes="1:1", nproc=3, env=env, name="nodeA")
    assert node.wait(200) == 0, node.log()[-3000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(r["diverged"] == [[1]] for r in reports), reports

    doc = json.loads(_status(nodes.etcd.endpoint, "diverge", "--json").stdout)
    diverged = [e for e in doc["events"] if e["kind"] == "diverged"]
    assert len(diverged) == 1, doc["events"]
    ev = diverged[0]
    assert ev["node"] == "nodeA" and ev["detail"]["rank"] == 1 and ev["detail"]["source"] in (0, 2), ev
    assert 2 * EVERY - 1 <= ev["detail"]["step"] < 3 * EVERY, ev
    assert "rank 1 diverged" in ev["message"], ev
    table = _status(nodes.etcd.endpoint, "diverge").stdout
    assert "diverged" in table and "nodeA" in table and "rank 1 diverged" in table, table
