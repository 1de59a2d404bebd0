"""sd_notify against a real AF_UNIX datagram socket (path and abstract namespace)."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid

import pytest
from structlog.testing import capture_logs

from elasticd.agent.sdnotify import MAX_STATUS_CHARS, SystemdNotifier, watchdog_interval_s


@pytest.fixture
def listener():
    """A bound datagram socket standing in for systemd; yields (socket, path)."""
    directory = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")  # sun_path is short: keep it so
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    try:
        yield sock, path
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(directory)


def received(sock: socket.socket) -> list[str]:
    return sock.recv(65536).decode().split("\n")


def test_ready_status_watchdog_stopping_extend_arrive(listener):
    """Each helper sends the documented assignments, one datagram per call."""
    sock, path = listener
    notifier = SystemdNotifier(path)
    assert notifier.enabled
    assert notifier.ready("joined round 3")
    assert received(sock) == ["READY=1", "STATUS=joined round 3"]
    assert notifier.status("training, world size 8")
    assert received(sock) == ["STATUS=training, world size 8"]
    assert notifier.watchdog()
    assert received(sock) == ["WATCHDOG=1"]
    assert notifier.stopping("draining")
    assert received(sock) == ["STOPPING=1", "STATUS=draining"]
    assert notifier.extend_timeout(90)
    assert received(sock) == ["EXTEND_TIMEOUT_USEC=90000000"]
    notifier.close()
    assert notifier.ready()  # reopens after close
    assert received(sock) == ["READY=1"]


def test_status_is_one_bounded_line(listener):
    """A multi-line or huge status cannot inject assignments or overflow the datagram."""
    sock, path = listener
    notifier = SystemdNotifier(path)
    notifier.status("line one\nREADY=1\n" + "x" * 5000)
    lines = received(sock)
    assert len(lines) == 1 and lines[0].startswith("STATUS=line one READY=1 x")
    assert len(lines[0]) == len("STATUS=") + MAX_STATUS_CHARS


def test_abstract_namespace_socket():
    """'@name' addresses the Linux abstract namespace."""
    name = f"elasticd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert SystemdNotifier("@" + name).ready()
        assert received(sock) == ["READY=1"]


@pytest.mark.parametrize("path", [None, ""])
def test_no_socket_is_a_quiet_no_op(path):
    """Without NOTIFY_SOCKET nothing is sent and nothing fails."""
    notifier = SystemdNotifier(path)
    assert not notifier.enabled
    assert notifier.ready("x") is False and notifier.watchdog() is False


def test_unreachable_socket_never_raises_and_logs_once(tmp_path):
    """A socket path nobody listens on: calls return False, one warning, no exception."""
    notifier = SystemdNotifier(str(tmp_path / "gone"))
    with capture_logs() as logs:
        results = [notifier.watchdog() for _ in range(3)]
    assert results == [False, False, False]
    assert [e["event"] for e in logs] == ["sd_notify_failed"]


def test_fast_loop_watchdog_pings_are_rate_limited(listener):
    """Pinging on every loop pass sends at most one WATCHDOG=1 per quarter interval."""
    sock, path = listener
    now = [100.0]
    notifier = SystemdNotifier(path, "60000000", clock=lambda: now[0])
    assert notifier.watchdog_interval_s == 30.0
    sent = []
    for _ in range(40):  # 40 passes of a 0.5 s loop = 20 s
        sent.append(notifier.watchdog())
        now[0] += 0.5
    assert sent.count(True) == 3  # at 0 s, 7.5 s and 15 s
    sock.settimeout(0.5)
    assert [received(sock) for _ in range(3)] == [["WATCHDOG=1"]] * 3


@pytest.mark.parametrize(
    ("usec", "wpid", "pid", "expected"),
    [
        ("60000000", None, None, 30.0),
        ("60000000", "42", 42, 30.0),
        ("60000000", "42", 43, None),  # watchdog meant for another process
        ("60000000", "42", None, None),
        (None, None, None, None),
        ("0", None, None, None),
        ("abc", None, None, None),
        ("60000000", "x", 1, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(usec, wpid, pid, expected):
    """Ping every WATCHDOG_USEC/2, only when the watchdog is set and meant for us."""
    assert watchdog_interval_s(usec, wpid, pid=pid) == expected


@pytest.mark.timeout(10)
def test_receiver_that_stopped_reading_never_blocks_the_agent(listener):
    """A full receive queue (nobody reads) drops messages instead of blocking the caller
    (a blocked send froze the agent loop mid-drain)."""
    _, path = listener
    notifier = SystemdNotifier(path)
    results = [notifier.status(f"tick {i}") for i in range(200)]
    assert results[0] is True and results[-1] is False
