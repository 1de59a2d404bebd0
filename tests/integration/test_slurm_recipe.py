"""deploy/slurm/elasticd.sbatch runs for real: its shell logic, a stub ``srun`` that starts
each task on this machine with its own ``SLURMD_NODENAME``, real etcd and real agents.

What it pins (issue 26 item 3): the agents' node ids are each node's own name, not the
batch shell's (expanded once on the first node, three of four agents refused as
duplicates, exit 78); a job that finished is not requeued (``status --json`` exits 2 for
it, and ``status | grep`` under ``pipefail`` read that as "not finished"); one that was
stopped by the time limit's SIGTERM is (``scontrol requeue``, recorded by a stub).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, children_of, wait_until

from elasticd.checkpoint.identity import new_run_id
from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys

SCRIPT = ROOT / "deploy" / "slurm" / "elasticd.sbatch"
STUBS = ROOT / "tests" / "stubs" / "slurm"
# Two tasks show what four did: each task's own node name (with the batch shell's name every
# task but one was refused as a duplicate), a full-size rendezvous, every agent drained.
NODES = 2
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _batch(tmp_path: Path, etcd, job: str, train_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment of the batch script as Slurm would run it on the first node."""
    wrapper = tmp_path / "elasticd"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m elasticd.cli \"$@\"\n")
    wrapper.chmod(0o755)
    env = {**os.environ,
           "PATH": f"{STUBS}:{os.environ['PATH']}",
           "ETCD": etcd.endpoint, "ELASTICD_JOB": job, "ELASTICD": str(wrapper),
           "CKPT": (tmp_path / "ckpt").as_uri(), "NPROC_PER_NODE": "1", "MIN_NODES": str(NODES),
           "SLURM_JOB_NUM_NODES": str(NODES), "SLURM_JOB_ID": "4242",
           # Slurm sets it in the batch shell too: the first node's name.
           "SLURMD_NODENAME": "gpu-0", "STUB_NODE_PREFIX": "gpu-",
           "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
           "ELASTICD_NODE_LOCAL_ADDR": "127.0.0.1", "ELASTICD_NODE_TTL_S": "2",
           # As the harness's nodes: no standby refill (a torch import a short job never uses).
           "ELASTICD_WORKERS_STANDBY_REFILL": "false"}
    argv = ["bash", str(SCRIPT), str(ROOT / "examples" / "train.py"), *train_args]
    return argv, env


def _start(argv: list[str], env: dict[str, str], out_path: Path) -> subprocess.Popen:
    """The batch script in a session of its own, its output (srun's too) to ``out_path``."""
    with open(out_path, "w") as out_file:
        return subprocess.Popen(argv, env=env, cwd=str(out_path.parent), stdout=out_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the batch script: srun, the agents and their workers (torch
    starts workers in sessions of their own, so the tree is walked, not the group)."""
    for pid in [proc.pid, *children_of(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


def _agent_events(out: str) -> list[dict]:
    """The agents' JSON events from srun's labelled output ("3: {...}")."""
    events = []
    for line in out.splitlines():
        m = re.match(r"(\d+): (\{.*\})$", line)
        if m:
            try:
                events.append({**json.loads(m.group(2)), "task": int(m.group(1))})
            except ValueError:
                continue
    return events


def _step_rows(events: list[dict]) -> list[dict]:
    """examples/train.py's per-step lines (rank 0), from its agent's worker_output events."""
    rows = []
    for e in events:
        if e.get("event") == "worker_output" and e.get("line", "").startswith('{"step"'):
            try:
                rows.append(json.loads(e["line"]))
            except ValueError:
                continue
    return rows


def _scontrol_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def test_nodes_join_under_their_own_names_and_a_finished_job_is_not_requeued(
        etcd_server, tmp_path):
    """NODES tasks, as many distinct node ids (SLURMD_NODENAME per task), train at world size
    NODES to the end; the script sees the closed rendezvous, exits 0 and never calls scontrol requeue."""
    argv, env = _batch(tmp_path, etcd_server, "slurm-done",
                       ["--steps", "12", "--dataset-size", "256", "--global-batch", "16",
                        "--micro-batch", "4"])
    out_path = tmp_path / "batch.out"
    batch = _start(argv, env, out_path)
    try:
        rc = batch.wait(180)
    finally:
        _kill_tree(batch)
    out = out_path.read_text()
    events = _agent_events(out)
    joined = {e.get("node") for e in events if e.get("event") == "rendezvous_completed"}
    assert joined == {f"gpu-{i}" for i in range(NODES)}, out[-4000:]
    assert all(e.get("node") == f"gpu-{e['task']}" for e in events if e.get("node")), out[-4000:]
    # The example's last line (a worker's JSON line becomes one of its agent's events).
    assert any(e.get("event") == "finished" and e.get("step") == 11 and e.get("rank") == 0
               for e in events), out[-4000:]
    assert any(r["world_size"] == NODES and r["step"] == 11 for r in _step_rows(events)), out[-4000:]
    assert "elasticd: job slurm-done finished (srun exit 0)" in out, out[-4000:]
    assert rc == 0, out[-4000:]
    assert _scontrol_calls(tmp_path) == [], out[-4000:]


def test_a_job_stopped_before_the_end_is_requeued(etcd_server, tmp_path):
    """SIGTERM to srun (Slurm's --signal before the time limit): every agent drains and
    exits 0, the rendezvous stays open, and the script calls scontrol requeue once."""
    argv, env = _batch(tmp_path, etcd_server, "slurm-requeue",
                       ["--steps", "100000", "--dataset-size", "256", "--global-batch", "16",
                        "--micro-batch", "4", "--step-sleep", "0.05"])
    out_path = tmp_path / "batch.out"
    batch = _start(argv, env, out_path)
    try:
        def training_at_full_size() -> bool:
            return any(r["world_size"] == NODES for r in _step_rows(_agent_events(out_path.read_text())))

        wait_until(training_at_full_size, 150, lambda: out_path.read_text()[-3000:])
        srun = subprocess.run(["pgrep", "-P", str(batch.pid), "-x", "srun"], capture_output=True,
                              text=True, timeout=10).stdout.split()
        assert len(srun) == 1, srun
        os.kill(int(srun[0]), signal.SIGTERM)
        assert batch.wait(120) == 0, out_path.read_text()[-4000:]
    finally:
        _kill_tree(batch)
    out = out_path.read_text()
    drained = {e.get("node") for e in _agent_events(out) if e.get("event") == "drain_started"}
    assert drained == {f"gpu-{i}" for i in range(NODES)}, out[-4000:]
    assert "not finished (srun exit 0, status exit" in out, out[-4000:]
    assert _scontrol_calls(tmp_path) == ["requeue 4242"], out[-4000:]


def test_a_job_stopped_with_elasticd_stop_is_not_requeued(etcd_server, tmp_path):
    """`elasticd stop` holds a job out until `elasticd start`: its agents drain and exit 0,
    and the script reads `"stop_requested": true` from `status --json` and exits without
    `scontrol requeue` (it requeued: the job then sat in the queue to start agents that
    refuse to join). The agents here are stand-ins that exit 0 as stopped agents do; the
    stop mark and the status are the real CLI's."""
    job = "slurm-stopped"
    client = EtcdClient(etcd_server.endpoint, timeout_s=3)
    try:
        client.put(JobKeys(job).run_id, new_run_id())
    finally:
        client.close()
    stop = subprocess.run([sys.executable, "-m", "elasticd.cli", "stop", "--etcd", etcd_server.endpoint,
                           "--job", job], capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    argv, env = _batch(tmp_path, etcd_server, job, ["--steps", "12"])
    (tmp_path / "elasticd").write_text(
        "#!/bin/sh\n[ \"$1\" = run ] && exit 0  # a stopped agent: drained, out, exit 0\n"
        f"exec {sys.executable} -m elasticd.cli \"$@\"\n")
    out_path = tmp_path / "batch.out"
    batch = _start(argv, env, out_path)
    try:
        rc = batch.wait(120)
    finally:
        _kill_tree(batch)
    out = out_path.read_text()
    assert rc == 0, out[-3000:]
    assert f"elasticd: job {job} stopped with elasticd stop" in out, out[-3000:]
    assert _scontrol_calls(tmp_path) == [], out[-3000:]
