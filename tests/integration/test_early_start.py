"""An agent's start-up imports no torch before its first standbys start (issue 14, join)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def test_the_cli_parser_and_the_rendezvous_protocol_do_not_import_torch():
    """`elasticd run` builds its parser (every subcommand's, `status` among them) before it
    starts the first standby; torch there cost every agent 2 s before its standby started."""
    code = ("import sys; from elasticd.cli import build_parser; build_parser(); "
            "import elasticd.rendezvous.protocol, elasticd.agent.early; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]


def _probe(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (so torch's absence is its own) and return the
    JSON object it printed last."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_node_registers_before_the_agent_imports_torch(etcd_server, tmp_path):
    """Issue 25 item 2: `boot_before_import` puts the node's record on a lease kept alive, and
    its join of the job's first round (opened by it: no round yet), with no torch imported,
    so a node started with the others is in the first round however slow its import; the
    outcome's close revokes both."""
    script = tmp_path / "x.py"  # the boot sequence fingerprints it (elasticd.agent.admission)
    script.write_text("pass\n")
    code = (
        "import sys, json\n"
        "from elasticd.config import load_config\n"
        "from elasticd.agent.boot import boot_before_import\n"
        "from elasticd.etcd.client import EtcdClient\n"
        "from elasticd.keys import JobKeys\n"
        f"cfg = load_config(None, {{}}, {{'etcd.endpoints': {etcd_server.endpoint!r}, "
        f"'job.name': 'early', 'job.nnodes': '1:2', 'node.id': 'n7', 'workers.command': {str(script)!r}}})\n"
        "a = boot_before_import(cfg)\n"
        "c = EtcdClient(cfg.etcd.endpoints[0])\n"
        "rec = c.get(JobKeys('early').node('n7'))\n"
        "joined = c.get(JobKeys('early').join(0, 'n7'))\n"
        "torch = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "a.close()\n"
        "print(json.dumps({'registered': rec is not None, 'lease': bool(rec and rec.lease),\n"
        "                  'joined': bool(joined and joined.lease == rec.lease),\n"
        "                  'torch': torch, 'after_close': c.get(JobKeys('early').node('n7')) is None,\n"
        "                  'finished': a.finished is not None}))\n"
    )
    assert _probe(code) == {
        "registered": True, "lease": True, "joined": True, "torch": [], "after_close": True,
        "finished": False}


def test_a_stopped_job_is_refused_by_the_boot_sequence_before_anything_registers(etcd_server, tmp_path):
    """The boot checks are one sequence (elasticd.agent.boot): on a stopped job
    `boot_before_import` answers the stop (reason and restart hint) first, with no torch
    imported, and registers nothing: no node record, no round, no join."""
    script = tmp_path / "x.py"
    script.write_text("pass\n")
    code = (
        "import sys, json\n"
        "from elasticd.config import load_config\n"
        "from elasticd.agent.boot import boot_before_import\n"
        "from elasticd.etcd.client import EtcdClient\n"
        "from elasticd.keys import JobKeys\n"
        "from elasticd.stopmarks import restart_hint, write_stop\n"
        f"cfg = load_config(None, {{}}, {{'etcd.endpoints': {etcd_server.endpoint!r}, "
        f"'job.name': 'stopped', 'job.nnodes': '1:2', 'node.id': 'n8', 'workers.command': {str(script)!r}}})\n"
        "keys = JobKeys('stopped')\n"
        "c = EtcdClient(cfg.etcd.endpoints[0])\n"
        "c.put(keys.run_id, b'run-1')\n"
        "write_stop(c, keys, reason='maintenance', by='test')\n"
        "a = boot_before_import(cfg)\n"
        "torch = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "refused = a is not None and a.refused is not None\n"
        "hint = restart_hint(a.refused) if refused else ''\n"
        "a.close()\n"
        "print(json.dumps({'refused': refused, 'session': a.session is not None,\n"
        "                  'node': c.get(keys.node('n8')) is not None,\n"
        "                  'round': c.get(keys.rdzv_state) is not None,\n"
        "                  'hint': 'elasticd start' in hint, 'torch': torch}))\n"
    )
    assert _probe(code) == {
        "refused": True, "session": False, "node": False, "round": False, "hint": True, "torch": []}


def test_a_node_id_a_live_agent_holds_is_refused_before_torch_is_imported(etcd_server, tmp_path):
    """A second agent started with a live agent's node id (on this host) is refused by
    `boot_before_import` with DuplicateNodeIdError (exit 78) naming the id and the fix, before
    torch is imported; the live agent's record is untouched."""
    script = tmp_path / "x.py"
    script.write_text("pass\n")
    # The holder: a live process whose command line names elasticd, on this host.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "elasticd"])
    try:
        code = (
            "import os, socket, sys, json, time\n"
            "from elasticd.config import load_config\n"
            "from elasticd.agent.boot import boot_before_import\n"
            "from elasticd.etcd.client import EtcdClient\n"
            "from elasticd.keys import JobKeys\n"
            "from elasticd.records import NodeRecord\n"
            "from elasticd.rendezvous.session import DuplicateNodeIdError\n"
            f"cfg = load_config(None, {{}}, {{'etcd.endpoints': {etcd_server.endpoint!r}, "
            f"'job.name': 'dup', 'job.nnodes': '1:2', 'node.id': 'a', 'workers.command': {str(script)!r}}})\n"
            "keys = JobKeys('dup')\n"
            "c = EtcdClient(cfg.etcd.endpoints[0])\n"
            "lease = c.grant_lease(30)\n"
            f"rec = NodeRecord(node='a', host=socket.gethostname(), pid={holder.pid}, version='v',\n"
            "                 started_at=time.time())\n"
            "c.put(keys.node('a'), rec.to_json(), lease=lease)\n"
            "try:\n"
            "    boot_before_import(cfg)\n"
            "    error = ''\n"
            "except DuplicateNodeIdError as exc:\n"
            "    error = str(exc)\n"
            "torch = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "kept = c.get(keys.node('a'))\n"
            "print(json.dumps({'named': \"node id 'a' is already used\" in error,\n"
            "                  'fix': '--node-id a / --node-id b' in error, 'torch': torch,\n"
            "                  'kept': bool(kept and kept.lease == lease)}))\n"
        )
        assert _probe(code) == {"named": True, "fix": True, "torch": [], "kept": True}
    finally:
        holder.kill()
        holder.wait()
