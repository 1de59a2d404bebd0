"""Spot notices drain the job; sd_notify messages reach systemd's socket (real agents)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from harness import ROOT, Node, read_jsonl, wait_until

SCRIPT = str(ROOT / "tests" / "workers" / "drainable.py")
pytestmark = pytest.mark.timeout(120)


class FakeMetadata:
    """A metadata server on 127.0.0.1 that answers 'no notice' until ``notice`` is set."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.notice = threading.Event()
        self.noticed_at = 0.0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_PUT(self):  # AWS IMDSv2 token
                self._send(200, b"token")

            def do_GET(self):
                if not outer.notice.is_set():
                    if outer.provider == "gcp":
                        return self._send(200, b"FALSE")
                    return self._send(404, b"")
                if outer.provider == "gcp":
                    return self._send(200, b"TRUE")
                deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(outer.noticed_at + 120))
                return self._send(200, json.dumps({"action": "terminate", "time": deadline}).encode())

            def _send(self, code, body):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def send_notice(self) -> None:
        self.noticed_at = time.time()
        self.notice.set()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _config(tmp_path, etcd, provider, url, lead=117):
    path = tmp_path / f"{provider}.toml"
    path.write_text(f"""
[job]
name = "notice-{provider}"
nnodes = "1"
[etcd]
endpoints = ["{etcd.endpoint}"]
[node]
id = "spot-0"
ttl_s = 2
local_addr = "127.0.0.1"
[workers]
command = ["{SCRIPT}"]
[preemption]
provider = "{provider}"
base_url = "{url}"
poll_interval_s = 0.2
drain_lead_s = {lead}
[logging]
format = "json"
""")
    return path


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_spot_notice_drains_before_the_deadline(tmp_path, etcd_server, provider):
    """A fake AWS/GCP preemption notice makes the agent drain: workers stop at a step, exit 0,
    well within the notice's deadline (AWS 120 s, GCP 30 s). With ``drain_lead_s = 117`` the
    AWS node trains on ~2-3 s past the notice first (GCP's 30 s is under the lead: at once)."""
    meta = FakeMetadata(provider)
    env = {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"), "STEP_S": "0.05"}
    node = Node([sys.executable, "-m", "elasticd.cli", "agent", "--config",
                 str(_config(tmp_path, etcd_server, provider, meta.url))], env, tmp_path / "agent.log")
    try:
        wait_until(lambda: len(read_jsonl(tmp_path / "steps.jsonl")) >= 5, 60, "first steps")
        meta.send_notice()
        assert node.wait(60) == 0, node.log()[-3000:]
        drained_in = time.time() - meta.noticed_at
        assert drained_in < 30, f"drain took {drained_in:.1f}s"
        log = node.log()
        assert "preemption notice" in log and "drain_started" in log
        steps = read_jsonl(tmp_path / "steps.jsonl")
        saved = json.loads((tmp_path / "ckpt.json").read_text())["step"]
        assert saved == max(r["step"] for r in steps)
        if provider == "aws":
            assert "drain_in_s" in log
            trained_on = max(float(r["time"]) for r in steps) - meta.noticed_at
            assert trained_on > 1.5, f"drained {trained_on:.1f}s after the notice, not at the lead"
    finally:
        node.cleanup()
        meta.close()


def test_sd_notify_messages(nodes, tmp_path):
    """READY after the first round, STATUS, WATCHDOG pings, and STOPPING on a drain."""
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(0.2)
    got: list[str] = []
    env = {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"), "STEP_S": "0.05",
           "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "2000000"}
    node = nodes.start("sd", SCRIPT, env=env, nnodes="1")

    def drain_socket():
        try:
            while True:
                got.append(sock.recv(4096).decode())
        except OSError:
            return got

    try:
        wait_until(lambda: any("READY=1" in m for m in drain_socket()), 60, "READY=1")
        wait_until(lambda: any("WATCHDOG=1" in m for m in drain_socket()), 10, "WATCHDOG=1")
        assert any("STATUS=" in m for m in got)
        node.signal_agent(15)
        assert node.wait(60) == 0
        drain_socket()
        assert any("STOPPING=1" in m for m in got), got
    finally:
        sock.close()
