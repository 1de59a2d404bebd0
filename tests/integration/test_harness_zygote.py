"""The suite's agent zygote (tests/elasticd_zygote.py) starts nodes as ``elasticd run``
would: the node's own environment, working directory, log file, session and exit status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from harness import ROOT, ForkedProc, Node, elasticd_argv, wait_until

pytestmark = pytest.mark.timeout(120)
DUMP_ENV = str(ROOT / "tests" / "workers" / "dump_env.py")


def test_a_forked_node_gets_its_own_environment_session_and_exit_status(etcd_server, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    argv = elasticd_argv(etcd_server.endpoint, "zyg", DUMP_ENV, nnodes="1")
    node = Node(argv, {"OUT": str(out), "ZYGOTE_MARK": "node-a"}, tmp_path / "a.log")
    try:
        assert isinstance(node.proc, ForkedProc), "an elasticd run node did not come from the zygote"
        wait_until(lambda: (out / "env-0.json").exists() or not node.alive(), 60,
                   lambda: f"the worker's environment dump:\n{node.log()[-3000:]}")
        dump = json.loads((out / "env-0.json").read_text())
        assert dump["environ"]["ZYGOTE_MARK"] == "node-a"  # the node's env reached its worker
        assert os.getsid(node.pid) == node.pid, "the agent is not in a session of its own"
        assert os.readlink(f"/proc/{node.pid}/cwd") == str(ROOT)
        assert '"agent_started"' in node.log()  # its log file is the node's
        (out / "done").touch()
        assert node.wait(60) == 0, node.log()[-3000:]
    finally:
        node.cleanup()


def test_a_forked_nodes_failure_and_kill_reach_its_exit_status(etcd_server, tmp_path):
    bad = Node(elasticd_argv(etcd_server.endpoint, "zyg-bad", str(tmp_path / "missing.py"), nnodes="1"),
               {}, tmp_path / "bad.log")
    killed = Node(elasticd_argv(etcd_server.endpoint, "zyg-kill", DUMP_ENV, nnodes="1"),
                  {"OUT": str(tmp_path)}, tmp_path / "kill.log")
    try:
        assert bad.wait(60) == 78, bad.log()[-3000:]  # a config error: EX_CONFIG
        wait_until(lambda: (tmp_path / "env-0.json").exists(), 60, "the worker")
        killed.signal(signal.SIGKILL)
        assert killed.wait(30) == -signal.SIGKILL
        with pytest.raises(subprocess.TimeoutExpired):
            ForkedProc(killed.proc.zygote, 1).wait(0.1)  # never its child: no status
    finally:
        bad.cleanup()
        killed.cleanup()


def test_a_node_with_other_import_time_environment_starts_fresh(etcd_server, tmp_path):
    node = Node(elasticd_argv(etcd_server.endpoint, "zyg-fresh", DUMP_ENV, nnodes="1"),
                {"OUT": str(tmp_path), "TORCH_SHOW_CPP_STACKTRACES": "7"},
                tmp_path / "fresh.log")
    try:
        assert isinstance(node.proc, subprocess.Popen)
    finally:
        node.cleanup()
