"""The worker launcher (``elasticd.agent.worker_exec``) in a real process: how a script's
end becomes the worker's exit (done marker, atexit, os._exit, exit 78), and process groups
destroyed by the script stay referenced (torch's gloo destructor race, issue 11 item 4)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

DDP_SCRIPT = """\
import atexit, os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
atexit.register(lambda: open(os.environ["ATEXIT_MARK"], "w").write("ran"))
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=0, world_size=1)
model = DDP(torch.nn.Linear(2, 1))
model(torch.ones(4, 2)).sum().backward()
dist.destroy_process_group()
import elasticd.teardown
print("kept", elasticd.teardown.kept_groups(), flush=True)
sys.exit(0)
"""

CONFIG_ERROR_SCRIPT = """\
from elasticd.data.batching import plan_global_batch
plan_global_batch(1, 4, 8)
"""


def _launch(tmp_path, script: str) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    control = tmp_path / "control"
    control.mkdir(exist_ok=True)
    env = {**os.environ, "ELASTICD_CONTROL_DIR": str(control), "RANK": "3",
           "STORE": str(tmp_path / "store"), "ATEXIT_MARK": str(tmp_path / "atexit-ran")}
    return subprocess.run([sys.executable, "-m", "elasticd.agent.worker_exec", str(path)],
                          capture_output=True, text=True, timeout=50, env=env)


def test_finished_script_writes_done_runs_atexit_and_keeps_destroyed_groups(tmp_path):
    """A DDP script that returns 0: exit 0, done-<rank> written, atexit handlers ran, and the
    groups destroy_process_group destroyed are still referenced (no C++ destructor ran)."""
    proc = _launch(tmp_path, DDP_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "control" / "done-3").exists()
    assert (tmp_path / "atexit-ran").read_text() == "ran"
    kept = int(proc.stdout.split("kept ", 1)[1].split()[0])
    assert kept >= 1, proc.stdout


def test_config_error_exits_78_without_done_marker(tmp_path):
    """An uncaught ConfigError: exit 78 (EX_CONFIG), traceback on stderr, no done marker."""
    proc = _launch(tmp_path, CONFIG_ERROR_SCRIPT)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "ConfigError" in proc.stderr and "World sizes that work" in proc.stderr
    assert not (tmp_path / "control" / "done-3").exists()


def test_failing_script_exits_1_and_sys_exit_codes_are_kept(tmp_path):
    """Any other exception exits 1 (traceback shown); sys.exit(5) exits 5; neither is done."""
    proc = _launch(tmp_path, "raise RuntimeError('boom')\n")
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr
    proc = _launch(tmp_path, "import sys\nsys.exit(5)\n")
    assert proc.returncode == 5
    assert not (tmp_path / "control" / "done-3").exists()


def test_worker_api_config_error_exits_78_without_the_launcher(tmp_path):
    """Under plain torchrun (no elasticd launcher) the worker API's excepthook turns an
    uncaught ConfigError into exit 78, so torchrun's restarts can be told apart too."""
    code = ("from elasticd import worker\nworker.init()\n"
            "from elasticd.data.batching import plan_global_batch\nplan_global_batch(1, 4, 8)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICD_", "MASTER_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=50, env={**env, "WORLD_SIZE": "1", "RANK": "0"})
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "ConfigError" in proc.stderr
