"""The state-transport contract (``elasticd.worker.transport.api``), one suite run against
every implementation: three real gloo ranks as processes on 127.0.0.1, a real SIGKILL of
the source mid-transfer, a real SIGSTOP of a source past the receiver's deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.etcd.embedded import free_port
from elasticd.worker.transport.api import TransportKind
from tests.harness import wait_until

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "workers" / "state_transport_contract.py"


@pytest.fixture(scope="module", params=list(TransportKind), ids=lambda k: k.value)
def run(request, tmp_path_factory) -> dict[str, dict]:
    """Three ranks run the four phases of the worker script once per transport."""
    kind: TransportKind = request.param
    out = tmp_path_factory.mktemp(f"contract-{kind.value}")
    port, reform_port = free_port(), free_port()
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OUT": str(out),
               "REFORM_PORT": str(reform_port), "TRANSPORT": kind.value, "PYTHONPATH": str(ROOT)}
        for key in ("ELASTICD_CONTROL_SOCKET", "ELASTICD_CONTROL_DIR", "ELASTICD_ROUND", "ELASTICD_LIVE"):
            env.pop(key, None)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT)], env=env))
    return _collect(procs, out, 90)


@pytest.mark.timeout(150)
def test_receivers_get_a_bit_identical_state_in_their_own_matching_tensors(run):
    """Both receivers get every tensor bit for bit (float64, bfloat16, bool, 0-dim,
    non-contiguous, nested); each receives in place into its own tensors that match in
    place, shape and dtype (those then hold the source's bytes) and allocates the rest:
    a partial receiver 3 of 8, a full one 7 of 8 (all but its non-contiguous one)."""
    for rank, in_place in (("1", 3), ("2", 7)):
        r = run[f"receive-{rank}"]
        assert r["same"] is True and r["own_hold_it"] is True, r
        assert (r["step"], r["lr"], r["x"]) == (41, 0.1, "x")
        assert r["in_place"] == in_place, r


@pytest.mark.timeout(150)
def test_a_rank_that_needs_nothing_gets_none_and_the_receiver_the_state(run):
    """With ``receivers=[1]`` rank 2 returns None (it takes part only where the mechanism
    needs every rank); rank 1 gets the whole state."""
    assert run["stand_by-2"]["none"] is True and run["stand_by-2"]["tensors"] == 0
    assert run["stand_by-1"]["same"] is True and run["stand_by-1"]["none"] is False


@pytest.mark.timeout(150)
def test_a_source_killed_mid_transfer_fails_every_receiver_at_once(run):
    """A source SIGKILLed after its first tensor: every receiver raises TransferError within
    seconds, not at its 30 s deadline (the caller then falls back to a restart)."""
    assert run["returncodes"]["0"] == -signal.SIGKILL
    for rank in ("1", "2"):
        r = run[f"die-{rank}"]
        assert r["error"] == "TransferError" and r["after_s"] < 15, r


@pytest.mark.timeout(150)
def test_a_stalled_source_fails_the_receiver_at_its_deadline(run):
    """A source that stops (SIGSTOP) before sending a byte: the receiver raises
    TransferError at its 2 s deadline, not at the group's 60 s timeout."""
    r = run["stall-2"]
    assert r["error"] == "TransferError" and 1.5 < r["after_s"] < 10, r
    assert run["returncodes"]["2"] == 0 and run["returncodes"]["1"] == -signal.SIGKILL


# -- the peer-RAM replica, a user of the seam, under the same contract ----------------------
REPLICA_SCRIPT = ROOT / "tests" / "workers" / "peer_replica_contract.py"


@pytest.fixture(scope="module")
def replica_run(tmp_path_factory) -> dict[str, dict]:
    """Three ranks run the replica's three phases once (exchange, die, stall)."""
    out = tmp_path_factory.mktemp("contract-peer-replica")
    port = free_port()
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "STORE_PORT": str(port), "OUT": str(out),
               "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, str(REPLICA_SCRIPT)], env=env))
    return _collect(procs, out, 120)


def _collect(procs: list[subprocess.Popen], out: Path, start_s: float) -> dict[str, dict]:
    """Wait for rank 2's stall report (it reports last; rank 1 is then stopped for good),
    end every rank still there (SIGKILL ends a stopped process too), read the reports."""
    try:
        wait_until(lambda: (out / "stall-2.json").exists() or procs[2].poll() is not None,
                   start_s,
                   lambda: f"rank 2's stall report; files: {sorted(p.name for p in out.iterdir())}")
        procs[2].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
    reports = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    reports["returncodes"] = {str(r): p.returncode for r, p in enumerate(procs)}
    return reports


@pytest.mark.timeout(180)
def test_the_peer_replica_exchanges_over_the_seam_bit_for_bit(replica_run):
    """A ring of three: each rank holds its predecessor's snapshot, bytes and JSON state equal."""
    for rank, peer in (("0", "2"), ("1", "0"), ("2", "1")):
        r = replica_run[f"exchange-{rank}"]
        assert r["error"] is None and r["held"] == {peer: True}, r


@pytest.mark.timeout(180)
def test_a_replica_source_killed_mid_transfer_fails_its_holder_at_once(replica_run):
    """Rank 0 SIGKILLed after 4 KiB of its snapshot: the holder's refresh fails with
    TransferError within seconds, not at its 30 s bound, and holds no partial replica."""
    assert replica_run["returncodes"]["0"] == -signal.SIGKILL
    r = replica_run["die-1"]
    assert r["error"] == "TransferError" and r["after_s"] < 15 and r["held"] == {}, r


@pytest.mark.timeout(180)
def test_a_stalled_replica_source_fails_its_holder_at_the_bound(replica_run):
    """Rank 1 stops (SIGSTOP) before sending a byte: rank 2's refresh fails with
    TransferError at its 2 s bound."""
    r = replica_run["stall-2"]
    assert r["error"] == "TransferError" and 1.5 < r["after_s"] < 10 and r["held"] == {}, r
    assert replica_run["returncodes"]["2"] == 0 and replica_run["returncodes"]["1"] == -signal.SIGKILL
