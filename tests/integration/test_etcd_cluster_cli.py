"""`elasticd etcd`: a foreground local etcd that prints its --etcd value and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest
from harness import ROOT, children_of, wait_until

from elasticd.etcd.client import EtcdClient
from elasticd.process import pid_alive

pytestmark = pytest.mark.timeout(90)


def _start(*args: str, stderr: Any = subprocess.DEVNULL) -> tuple[subprocess.Popen, str, list[int]]:
    """Start ``elasticd etcd ARGS``; return it, the endpoints it printed, and its etcd PIDs."""
    proc = subprocess.Popen([sys.executable, "-m", "elasticd.cli", "etcd", *args], cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            start_new_session=True)
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(60)
    if not box or not box[0].startswith("--etcd "):
        proc.kill()
        raise AssertionError(f"elasticd etcd printed {box!r}, not '--etcd HOST:PORT,...'")
    return proc, box[0].split()[1], children_of(proc.pid)


def _stop(proc: subprocess.Popen, pids: list[int]) -> int:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "every etcd member to exit")
    return code


def test_etcd_command_serves_a_three_member_cluster_and_keeps_its_data(tmp_path):
    """--members 3 prints three endpoints that serve; SIGTERM exits 0 leaving no etcd behind;
    a second run on the same --data-dir reuses the ports and still holds the data."""
    data = tmp_path / "etcd"
    proc, endpoints, pids = _start("--members", "3", "--data-dir", str(data))
    try:
        assert len(endpoints.split(",")) == 3 and len(pids) == 3
        client = EtcdClient(endpoints, timeout_s=2.0)
        client.put("/kept", "yes")
        client.close()
    finally:
        code = _stop(proc, pids)
    assert code == 0
    proc, again, pids = _start("--members", "3", "--data-dir", str(data))
    try:
        assert again == endpoints
        client = EtcdClient(again, timeout_s=2.0)
        assert client.get("/kept").value == b"yes"
        client.close()
    finally:
        assert _stop(proc, pids) == 0
    bad = subprocess.run([sys.executable, "-m", "elasticd.cli", "etcd", "--members", "1",
                          "--data-dir", str(data)], capture_output=True, text=True, timeout=30,
                         cwd=str(ROOT))
    assert bad.returncode == 78 and "--members 3" in bad.stderr


def test_etcd_command_stops_on_ctrl_c(tmp_path):
    """One member by default; Ctrl-C (SIGINT) stops it with exit 0 and removes its temp dir."""
    proc, endpoints, pids = _start()
    assert len(endpoints.split(",")) == 1 and len(pids) == 1
    with open(f"/proc/{pids[0]}/cmdline", "rb") as fh:
        argv = fh.read().decode().split("\0")
    member_dir = argv[argv.index("--data-dir") + 1]  # <temp root>/m0/member
    root = os.path.dirname(os.path.dirname(member_dir))
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    wait_until(lambda: not pid_alive(pids[0]), 10, "etcd to exit")
    assert not os.path.exists(root)


def test_etcd_command_says_it_serves_plaintext(tmp_path):
    """`elasticd etcd` says at start that its clients are served in plaintext without auth
    (every local user can read and write it), pointing at --standalone for a private one."""
    with open(tmp_path / "stderr", "w") as err:
        proc, _, pids = _start(stderr=err)
        try:
            wait_until(lambda: "Ctrl-C" in (tmp_path / "stderr").read_text(), 10, "the start lines")
        finally:
            assert _stop(proc, pids) == 0
    text = (tmp_path / "stderr").read_text()
    assert "plaintext" in text and "every local user" in text and "--standalone" in text, text
