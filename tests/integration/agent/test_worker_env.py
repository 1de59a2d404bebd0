"""Workers and warm standbys never hold etcd credentials; they do get the round (public path)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import PY, ROOT, Node, children_of, wait_until

from elasticd.etcd.embedded import EmbeddedEtcd, ServerTLS, find_etcd_binary

SCRIPT = str(ROOT / "tests" / "workers" / "dump_env.py")
SECRET = "pw-Secret-4711"
pytestmark = pytest.mark.timeout(120)


def _environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        raw = fh.read().decode(errors="replace").split("\0")
    return dict(kv.split("=", 1) for kv in raw if "=" in kv)


def _leaks(env: dict[str, str]) -> list[str]:
    return sorted(k for k, v in env.items()
                  if k.startswith(("ELASTICD_ETCD_", "ETCDCTL_")) or k == "ELASTICD_CONFIG" or SECRET in v)


def _make_pki(root: Path) -> Any:
    # The TLS test module's PKI builder (tests/integration is not a package).
    spec = importlib.util.spec_from_file_location(
        "elasticd_test_etcd_tls", ROOT / "tests" / "integration" / "test_etcd_tls.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module.make_pki(root)


@pytest.fixture
def auth_etcd(tmp_path):
    """An etcd over TLS (client certificates) with password auth on: user root / SECRET."""
    pki = _make_pki(tmp_path / "pki")
    server = EmbeddedEtcd(str(tmp_path / "etcd"), tls=ServerTLS(pki.server_cert, pki.server_key, pki.ca))
    server.start()
    etcdctl = os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")
    tls = ["--endpoints", f"https://{server.endpoint}", "--cacert", pki.ca, "--cert",
           pki.client_cert, "--key", pki.client_key]
    try:
        for args in (["user", "add", "root", f"--new-user-password={SECRET}", "--interactive=false"],
                     ["user", "grant-role", "root", "root"], ["auth", "enable"]):
            subprocess.run([etcdctl, *tls, *args], check=True, capture_output=True, timeout=30)
        yield server, pki
    finally:
        server.stop(remove_data=True)


def test_no_etcd_credential_reaches_workers_or_standbys(auth_etcd, tmp_path):
    """An agent configured through ELASTICD_ETCD_* (endpoints, CA/cert/key, user and password
    on an etcd with TLS and auth on), plus ELASTICD_CONFIG and ETCDCTL_*: its worker's
    environment (os.environ and the process's initial environ) and its warm standbys' hold
    none of them and no password, but do hold the round and the control socket."""
    server, pki = auth_etcd
    out = tmp_path / "out"
    out.mkdir()
    config = tmp_path / "agent.toml"
    config.write_text("")
    env = {
        "ELASTICD_ETCD_ENDPOINTS": server.endpoint, "ELASTICD_ETCD_USER": "root",
        "ELASTICD_ETCD_PASSWORD": SECRET, "ELASTICD_ETCD_CA_FILE": pki.ca,
        "ELASTICD_ETCD_CERT_FILE": pki.client_cert, "ELASTICD_ETCD_KEY_FILE": pki.client_key,
        "ELASTICD_CONFIG": str(config), "ETCDCTL_PASSWORD": SECRET, "OUT": str(out),
    }
    node = Node([PY, "-m", "elasticd.cli", "run", "--job", "envjob", "--nnodes", "1",
                 "--node-ttl", "2", "--local-addr", "127.0.0.1", "--log-format", "json", SCRIPT],
                env, tmp_path / "agent.log")
    try:
        wait_until(lambda: (out / "env-0.json").exists() or not node.alive(), 90, "the worker's env dump")
        assert node.alive(), node.log()[-3000:]
        dump = json.loads((out / "env-0.json").read_text())
        for view in ("environ", "proc_environ"):
            assert _leaks(dump[view]) == [], f"credentials in the worker's {view}"
        assert dump["environ"]["ELASTICD_ROUND"].isdigit()
        # The first worker was a warm standby taking over: the round reached it at the hand-over.
        assert "standby_handed_over" in node.log(), node.log()[-3000:]
        assert dump["environ"]["ELASTICD_CONTROL_SOCKET"]

        def standbys() -> list[int]:
            pids = []
            for pid in children_of(node.pid):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        if b"elasticd.agent.warm" in fh.read():
                            pids.append(pid)
                except OSError:
                    continue
            return pids

        sb = wait_until(standbys, 60, "a warm standby")
        for pid in sb:
            assert _leaks(_environ_of(pid)) == [], "credentials in a warm standby's environ"
    finally:
        (out / "done").touch()
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            pass
        node.cleanup()
    assert node.proc.returncode == 0, node.log()[-3000:]
