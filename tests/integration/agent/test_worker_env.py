"""Workers and warm standbys never hold etcd credentials; they do get the round (public path)."""

from __future__ import annotations

import json
import subprocess

import pytest
from harness import ROOT, Node, children_of, elasticd_argv, wait_until

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


def test_no_etcd_credential_reaches_workers_or_standbys(etcd_server, tmp_path):
    """An agent whose environment holds every etcd credential variable (endpoints, user,
    password, password file, CA/cert/key, config path, etcdctl's): its worker's environment
    (os.environ and the process's initial environ) and its warm standbys' hold none of them
    and no password, but do hold the round and the control socket."""
    out = tmp_path / "out"
    out.mkdir()
    pw_file = tmp_path / "pw"
    pw_file.write_text(SECRET)
    env = {
        "ELASTICD_ETCD_ENDPOINTS": etcd_server.endpoint, "ELASTICD_ETCD_USER": "root",
        "ELASTICD_ETCD_PASSWORD": SECRET, "ELASTICD_ETCD_PASSWORD_FILE": str(pw_file),
        "ELASTICD_ETCD_CA_FILE": "/etc/elasticd/ca.pem", "ELASTICD_ETCD_CERT_FILE": "/etc/elasticd/c.pem",
        "ELASTICD_ETCD_KEY_FILE": "/etc/elasticd/k.pem", "ELASTICD_CONFIG": "/etc/elasticd/agent.toml",
        "ETCDCTL_PASSWORD": SECRET, "OUT": str(out),
    }
    # `elasticd run` takes its etcd settings from flags, so these variables are inert for the
    # agent itself; without scrubbing, every worker would inherit them.
    node = Node(elasticd_argv(etcd_server.endpoint, "envjob", SCRIPT, nnodes="1"), env,
                tmp_path / "agent.log")
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
