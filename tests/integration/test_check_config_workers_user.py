"""`elasticd agent --check-config` refuses a workers.user the start refuses (exit 78)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["non-pem-ca", "foreign-data-dir"])
def test_check_config_refuses_a_non_pem_ca_and_a_foreign_data_dir(tmp_path, case):
    """An etcd CA file that is not PEM, or an etcd data dir another user owns: the start
    refuses both (exit 78), so --check-config does too, naming the setting's file."""
    if case == "non-pem-ca":
        bad = tmp_path / "ca.der"
        bad.write_bytes(b"\x30\x82\x01\x0a not a PEM file")
        etcd = f'[etcd]\nendpoints = ["https://127.0.0.1:2379"]\nca_file = "{bad}"\n'
    else:
        if os.geteuid() == 0:  # CI runs as root: give a fresh dir to nobody
            bad = tmp_path / "etcd-data"
            bad.mkdir()
            os.chown(bad, 65534, 65534)
        else:  # anyone else: root's / is another user's directory
            bad = Path("/")
        etcd = f'[etcd]\ndata_dir = "{bad}"\n'
    path = tmp_path / "elasticd.toml"
    path.write_text('[workers]\ncommand = ["train.py"]\n[job]\nname = "j"\n' + etcd)
    proc = subprocess.run([sys.executable, "-m", "elasticd.cli", "agent", "--check-config", "-c",
                           str(path)], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 78, proc.stdout[-500:] + proc.stderr[-2000:]
    assert str(bad) in proc.stderr and "Traceback" not in proc.stderr
