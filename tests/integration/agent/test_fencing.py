"""Zombies: a node frozen past its TTL comes back after the job moved on (issue: fencing)."""

from __future__ import annotations

import json
import signal
import time

import pytest
from harness import ROOT, read_jsonl, wait_until

from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys

SCRIPT = str(ROOT / "tests" / "workers" / "allreduce.py")
EXAMPLE = str(ROOT / "examples" / "train.py")
pytestmark = pytest.mark.timeout(180)


def _env(out):
    return {"OUT": str(out), "STEPS": "100000", "STEP_S": "0.05"}


def _events(etcd, job):
    c = EtcdClient(etcd.endpoint)
    try:
        kvs, _ = c.get_prefix(JobKeys(job).events_prefix)
        return [json.loads(kv.value) for kv in kvs]
    finally:
        c.close()


def test_frozen_node_then_frozen_agent_rejoin_as_new_members(nodes, tmp_path):
    """A node frozen past its TTL, then (after it rejoined) only its agent (a partition):
    each time the others go on at world 2, and after SIGCONT the zombie rejoins at a later
    round at world 3."""
    out = tmp_path / "steps.jsonl"
    ns = [nodes.start("z1", SCRIPT, env=_env(out), nnodes="2:3", extra=["--max-restarts", "0"])
          for _ in range(3)]
    wait_until(lambda: len([r for r in read_jsonl(out) if r["world"] == 3]) >= 6, 60, "world 3")
    zombie = ns[2]
    # Two phases of one job (a job each only paid three more agent starts).
    lost_before = 0
    for freeze, stop in (("node", zombie.signal), ("agent", zombie.signal_agent)):
        stop(signal.SIGSTOP)
        t_freeze = time.time()
        wait_until(lambda t=t_freeze: len([r for r in read_jsonl(out) if r["world"] == 2 and r["time"] > t]) >= 6,
                   60, f"world 2 without the frozen {freeze}")
        stop(signal.SIGCONT)
        t_wake = time.time()
        wait_until(lambda t=t_wake: len([r for r in read_jsonl(out) if r["world"] == 3 and r["time"] > t]) >= 6,
                   90, f"world 3 after the zombie ({freeze} frozen) rejoined")
        events = _events(nodes.etcd, "z1")
        lost = [e for e in events if e["kind"] == "lease_lost" and e["node"] == "n2"]
        assert len(lost) > lost_before, \
            f"no lease_lost event for the zombie ({freeze} frozen): {[e['kind'] for e in events]}"
        lost_before = len(lost)
        assert all(n.alive() for n in ns)


def test_checkpoint_pointer_never_moves_back_around_a_zombie(nodes, tmp_path):
    """The example on 3 nodes, one frozen past its TTL and woken after the others committed
    newer checkpoints: the `latest` pointer's (round, step) only moves forward, and once the
    job re-formed it never names a checkpoint of the zombie's old round."""
    import threading

    args = ["--steps", "100000", "--step-sleep", "0.05", "--checkpoint-every", "3"]
    extra = ["--checkpoint-url", f"file://{tmp_path}/ckpt", "--max-restarts", "0"]
    ns = [nodes.start("z2", EXAMPLE, nnodes="2:3", extra=extra, script_args=args) for _ in range(3)]
    client = EtcdClient(nodes.etcd.endpoint, timeout_s=2)
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def watch_pointer():
        while not stop.wait(0.1):
            try:
                kv = client.get(JobKeys("z2").checkpoint_latest)
            except Exception:
                continue
            if kv is not None:
                p = json.loads(kv.value)
                if not seen or seen[-1] != (p["round"], p["step"]):
                    seen.append((p["round"], p["step"]))

    t = threading.Thread(target=watch_pointer, daemon=True)
    t.start()
    try:
        wait_until(lambda: len(seen) >= 2, 90, "checkpoints committed at world 3")
        round_before = seen[-1][0]
        ns[2].signal(signal.SIGSTOP)
        wait_until(lambda: any(r > round_before for r, _ in seen) and len(seen) >= 4, 90,
                   "newer checkpoints committed without the frozen node")
        ns[2].signal(signal.SIGCONT)
        wait_until(lambda: "lease_lost" in ns[2].log(), 60, "the zombie noticing its lost lease")
        wait_until(lambda: seen[-1][0] > max(r for r, _ in seen[:-1]) or len(seen) >= 8, 60,
                   "commits after the zombie woke")
    finally:
        stop.set()
        t.join(5)
        client.close()
    assert seen == sorted(seen), f"pointer moved backwards: {seen}"
    reformed = next(i for i, (r, _) in enumerate(seen) if r > round_before)
    assert all(r > round_before for r, _ in seen[reformed:]), seen
