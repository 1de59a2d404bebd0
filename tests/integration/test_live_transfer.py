"""Live re-formation's state transfer over TCP (issue 14): real sockets on 127.0.0.1, real
gloo ranks as processes, a real SIGKILL of the source mid-transfer."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from elasticd.etcd.embedded import free_port
from elasticd.worker.transfer import (
    HELLO,
    TransferError,
    TransferSource,
    byte_view,
    encode_hello,
    new_ticket,
    receive,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "workers" / "state_transfer.py"


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> tuple[list[dict], list[dict], dict]:
    """Three gloo ranks run both phases of the worker script once (start-up is the cost)."""
    out = tmp_path_factory.mktemp("transfer")
    port, reform_port = free_port(), free_port()
    procs = []
    for rank in range(3):
        (out / f"cd{rank}").mkdir()
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OUT": str(out),
               "REFORM_PORT": str(reform_port), "ELASTICD_CONTROL_DIR": str(out / f"cd{rank}"),
               "PYTHONPATH": str(ROOT)}
        for key in ("ELASTICD_CONTROL_SOCKET", "ELASTICD_ROUND", "ELASTICD_LIVE"):
            env.pop(key, None)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT)], env=env))
    try:
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def read(name: str) -> dict:
        path = out / name
        return json.loads(path.read_text()) if path.exists() else {}

    marker, started = out / "cd1" / "stopped-1", out / "rank1-reform-started"
    fell_back = {**read("cd1/stopped-1"),
                 "after_s": marker.stat().st_mtime - float(started.read_text())} \
        if marker.exists() and started.exists() else {}
    return ([read(f"rank{r}.json") for r in range(3)],
            [{"returncode": p.returncode, **read(f"rank{r}-kill.json")} for r, p in enumerate(procs)],
            fell_back)


@pytest.mark.timeout(90)
def test_three_gloo_ranks_receive_a_bit_identical_state(three_ranks):
    """Both receivers get every tensor bit for bit (float64, bfloat16, bool, 0-dim,
    non-contiguous, nested), over TCP; the one with its own tensors receives in place."""
    reports = three_ranks[0]
    for r in reports[1:]:
        assert r.get("same") is True, r
        assert (r["step"], r["lr"], r["x"]) == (41, 0.1, "x")
    assert reports[1]["in_place"] == 0
    assert reports[2]["in_place"] == 7  # all but the non-contiguous tensor: allocated


@pytest.mark.timeout(90)
def test_a_source_killed_mid_transfer_makes_the_receiver_fall_back_at_once(three_ranks):
    """A live re-formation whose source is SIGKILLed after its first tensor: the receiver falls back
    (its stopped marker names the TransferError, exit 0: the agent restarts from the
    checkpoint) within seconds, not at its 30 s bound; a rank that needed nothing
    re-forms."""
    ranks, fell_back = three_ranks[1], three_ranks[2]
    assert ranks[0]["returncode"] == -9  # killed mid-transfer
    assert ranks[1]["returncode"] == 0 and "TransferError" in fell_back["live_fallback"], fell_back
    assert "closed the connection after" in fell_back["live_fallback"] or "reset" in fell_back["live_fallback"]
    assert fell_back["after_s"] < 15
    assert ranks[2]["returncode"] == 0 and ranks[2]["reforms"] == 1 and ranks[2]["step"] == 41


def _serve_in_thread(source: TransferSource, receivers: list[int], deadline: float) -> dict:
    result: dict = {}

    def run() -> None:
        try:
            source.serve(receivers, deadline)
            result["ok"] = True
        except TransferError as exc:
            result["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    result["thread"] = th
    return result


@pytest.mark.timeout(30)
def test_a_stranger_gets_no_state_and_the_member_still_does():
    """A connection with a wrong token, or a member's token for a rank already served, is
    closed without a byte of state; the real receiver is served."""
    data = torch.arange(1 << 16, dtype=torch.float64)
    source = TransferSource("127.0.0.1", [byte_view(data)])
    deadline = time.monotonic() + 20
    result = _serve_in_thread(source, [1], deadline)
    addr = ("127.0.0.1", source.ticket.port)
    with socket.create_connection(addr, timeout=5) as stranger:
        stranger.sendall(encode_hello(1, b"\0" * 32))
        assert stranger.recv(1 << 16) == b""  # closed, nothing sent
    got = torch.empty_like(data)
    receive(source.ticket, 1, [byte_view(got)], deadline)
    assert torch.equal(got, data)
    result["thread"].join(5)
    assert result.get("ok") and source.refused == 1
    with pytest.raises(OSError):  # the listener is gone once every receiver is served
        socket.create_connection(addr, timeout=2).close()


@pytest.mark.timeout(30)
def test_a_receiver_refuses_state_from_a_peer_without_the_send_token():
    """A listener at the published address that does not prove the send token (a stranger
    on a reused port) is refused before any state is read."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        ticket = new_ticket("127.0.0.1", fake.getsockname()[1], [memoryview(bytearray(8))])

        def impostor() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.recv(HELLO.size)
                conn.sendall(b"EDX1" + b"\1" * 32 + (8).to_bytes(8, "big") + (1).to_bytes(4, "big"))
                conn.sendall(b"\xff" * 8)

        th = threading.Thread(target=impostor, daemon=True)
        th.start()
        buf = bytearray(8)
        with pytest.raises(TransferError, match="did not prove"):
            receive(ticket, 1, [memoryview(buf)], time.monotonic() + 10)
        assert buf == bytearray(8)
        th.join(5)


@pytest.mark.timeout(30)
def test_a_connection_from_outside_the_group_is_refused_and_the_wait_is_bounded():
    """Only the group's peer addresses may connect; a receiver that never comes ends the
    transfer at its deadline with TransferError (not a hang)."""
    source = TransferSource("127.0.0.1", [memoryview(bytearray(8))], allowed_peers=frozenset({"192.0.2.1"}))
    deadline = time.monotonic() + 1.0
    result = _serve_in_thread(source, [1], deadline)
    with pytest.raises(TransferError):
        receive(source.ticket, 1, [memoryview(bytearray(8))], deadline)
    result["thread"].join(5)
    assert isinstance(result.get("error"), TransferError) and source.refused == 1


@pytest.mark.timeout(30)
def test_a_connect_flood_is_capped_and_silent_strangers_are_dropped_after_the_hello_timeout():
    """200 silent connections hold at most MAX_UNIDENTIFIED threads (the oldest silent one
    is dropped for a newcomer), each is closed after HELLO_TIMEOUT_S (not at the 20 s
    deadline), and the real receiver is still served."""
    import elasticd.worker.transfer as tr

    # (getattr: so that on the code before the cap the test fails on the behaviour)
    HELLO_TIMEOUT_S, MAX_UNIDENTIFIED = getattr(tr, "HELLO_TIMEOUT_S", 2.0), getattr(tr, "MAX_UNIDENTIFIED", 64)  # noqa: N806

    data = torch.arange(1 << 12, dtype=torch.float64)
    source = TransferSource("127.0.0.1", [byte_view(data)])
    deadline = time.monotonic() + 20
    before = threading.active_count()
    result = _serve_in_thread(source, [1], deadline)
    addr = ("127.0.0.1", source.ticket.port)
    flood = []
    try:
        t0 = time.monotonic()
        for _ in range(200):
            flood.append(socket.create_connection(addr, timeout=5))
        peak = 0
        while time.monotonic() - t0 < 0.5:
            peak = max(peak, threading.active_count() - before)
            time.sleep(0.01)
        assert peak <= MAX_UNIDENTIFIED + 2, f"{peak} threads for a flood of 200 connections"
        last = flood[-1]  # the newest: kept in the table until its hello timeout
        # (a SYN over the listen backlog is retried by the kernel after 1 s, 3 s: margin)
        last.settimeout(HELLO_TIMEOUT_S + 6)
        assert last.recv(1) == b"", "a silent stranger was held past its hello timeout"
        got = torch.empty_like(data)
        receive(source.ticket, 1, [byte_view(got)], deadline)  # slots freed: served
        assert torch.equal(got, data)
        result["thread"].join(5)
        assert result.get("ok") and source.refused_crowded > 0
    finally:
        for s in flood:
            s.close()


@pytest.mark.timeout(420)
def test_a_non_finite_state_is_never_sent_and_with_none_usable_the_ranks_fall_back(tmp_path):
    """A live re-formation where holder rank 0's weights hold a NaN: it offers no state
    (logged with the reason), the other holder (rank 2) feeds ranks 0 and 1, and all end
    with rank 2's finite state; a second re-formation where every rank's state is
    non-finite sends nothing: every rank falls back to the restart path (exit 0, the
    checkpoint tier), naming why, instead of re-forming in a loop. Between the two, one
    rank's NaN first loss after the transfer refuses it on every rank at the same step."""
    script = ROOT / "tests" / "workers" / "non_finite_transfer.py"
    port, reform, reform2 = free_port(), free_port(), free_port()
    procs, logs = [], []
    for rank in range(3):
        (tmp_path / f"cd{rank}").mkdir()
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OUT": str(tmp_path),
               "REFORM_PORT": str(reform), "REFORM_PORT2": str(reform2),
               "ELASTICD_CONTROL_DIR": str(tmp_path / f"cd{rank}"), "PYTHONPATH": str(ROOT)}
        for key in ("ELASTICD_CONTROL_SOCKET", "ELASTICD_ROUND", "ELASTICD_LIVE"):
            env.pop(key, None)
        logs.append(tmp_path / f"log{rank}")
        with open(logs[-1], "w") as fh:
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=fh,
                                          stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=360)  # 3 torch start-ups: over 120 s at a load of 94
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = [log.read_text() for log in logs]
    round1 = [t.split("live_reformed")[0] for t in text]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(text)[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert all(r["step"] == 41 and r["finite"] for r in reports), reports
    assert len({r["print"] for r in reports}) == 1, reports
    assert "live_state_not_offered" in round1[0] and "live_state_not_offered" not in round1[2], text
    assert "live_state_sent" in round1[2] and "live_state_not_offered" in text[2]  # round 2
    for r in (0, 1):
        assert "live_state_received" in round1[r] and "source=2" in round1[r], text[r][-2000:]
    refused = [(tmp_path / f"refused{r}.txt").read_text() for r in range(3)]
    assert "was nan at step 42" in refused[1], refused  # the rank that saw it
    assert all("first loss after restoring the state rank 2 sent at step 41" in t
               or "another rank's first loss after restoring the state rank 2 sent" in t
               for t in refused), refused
    for r in range(3):  # round 2: every rank fell back, naming why
        stopped = [f for f in (tmp_path / f"cd{r}").iterdir() if f.name.startswith("stopped")]
        assert stopped, f"rank {r} did not fall back: {text[r][-2000:]}"
        assert "no rank holds a usable state" in stopped[0].read_text(), stopped[0].read_text()
