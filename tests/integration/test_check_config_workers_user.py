"""`elasticd agent --check-config` refuses a workers.user the start refuses (exit 78)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CONFIG = '[workers]\ncommand = ["train.py"]\nuser = "{user}"\n[job]\nname = "j"\n'


@pytest.mark.timeout(120)
@pytest.mark.parametrize("user", ["root", "no-such-user-elasticd-44"])
def test_check_config_refuses_a_root_or_missing_workers_user(tmp_path, user):
    """workers.user = "root" or a user that does not exist: --check-config exits 78 naming it."""
    path = tmp_path / "elasticd.toml"
    path.write_text(CONFIG.format(user=user))
    proc = subprocess.run([sys.executable, "-m", "elasticd.cli", "agent", "--check-config", "-c",
                           str(path)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 78, proc.stdout[-500:] + proc.stderr[-2000:]
    assert f"workers.user = {user!r}" in proc.stderr and "Traceback" not in proc.stderr
