"""The systemd units pass `systemd-analyze verify` and agree with the agent's config."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from elasticd.config import DrainConfig
from elasticd.errors import EX_CONFIG

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
UNITS = ["elasticd.service", "elasticd@.service"]
INSTALLED_BINARY = "/usr/local/bin/elasticd"


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
    if not os.access(path, os.X_OK):
        pytest.fail(
            "systemd-analyze not found: install Debian's systemd package "
            "(apt-get install systemd) to verify the unit files"
        )
    return path


def verify(unit_path: Path) -> list[str]:
    """Run systemd-analyze verify; return its complaints about our unit."""
    result = subprocess.run(
        [systemd_analyze(), "verify", str(unit_path)],
        capture_output=True, text=True, timeout=30, cwd=unit_path.parent,
    )
    output = (result.stdout + result.stderr).splitlines()
    # verify reports unknown keys and bad values as warnings with exit status 0, so
    # any line about our file is a failure; lines about system units are not ours.
    ours = [line for line in output if unit_path.name in line or str(unit_path) in line]
    if result.returncode != 0:
        ours.append(f"exit status {result.returncode}: {' | '.join(output)}")
    return ours


def unit_text(name: str) -> str:
    return (REPO / "systemd" / name).read_text()


@pytest.mark.parametrize("name", UNITS)
def test_unit_passes_systemd_analyze_verify(tmp_path, name):
    """systemd-analyze verify accepts the unit (ExecStart pointed at a stand-in binary)."""
    binary = tmp_path / "bin" / "elasticd"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    text = unit_text(name)
    assert f"ExecStart={INSTALLED_BINARY} " in text
    # verify insists that ExecStart's binary exists; the real one is installed later.
    text = text.replace(INSTALLED_BINARY, str(binary))
    targets = [name] if "@." not in name else [name, name.replace("@.", "@demo-job.")]
    for target in targets:
        unit = tmp_path / target
        unit.write_text(text)
        assert verify(unit) == [], f"{target} has problems"


def test_verify_catches_a_broken_unit(tmp_path):
    """The check is real: a misspelt key in a copy of the unit is reported."""
    unit = tmp_path / "broken.service"
    unit.write_text(
        unit_text("elasticd.service")
        .replace(INSTALLED_BINARY, "/bin/true")
        .replace("KillMode=mixed", "KillMod=mixed")
    )
    assert any("KillMod" in line for line in verify(unit))


def setting(text: str, key: str) -> str:
    match = re.search(rf"^{key}=(.*)$", text, re.M)
    assert match, f"{key}= missing"
    return match.group(1).strip()


@pytest.mark.parametrize("name", UNITS)
def test_unit_policy_matches_the_agent(name):
    """Stop timeout outlasts the default drain; config errors (exit 78) are not restarted."""
    text = unit_text(name)
    assert setting(text, "Type") == "notify"
    assert setting(text, "NotifyAccess") == "main"
    assert setting(text, "KillMode") == "mixed"
    assert setting(text, "Restart") == "on-failure"
    assert setting(text, "RestartPreventExitStatus") == str(EX_CONFIG)
    assert int(setting(text, "TimeoutStopSec")) >= DrainConfig().grace_s + 30
    assert int(setting(text, "WatchdogSec")) > 0
    for forbidden in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock",
                      "MemoryDenyWriteExecute"):
        assert not re.search(rf"^{forbidden}=", text, re.M), f"{forbidden} would break GPUs"


def test_environment_file_example_is_valid():
    """elasticd.env.example holds comments and (commented) KEY=VALUE lines naming real keys."""
    from elasticd.config.schema import KEYS

    env_vars = {key.env_var for key in KEYS.values()}
    for number, line in enumerate(
        (REPO / "systemd" / "elasticd.env.example").read_text().splitlines(), 1
    ):
        assignment = line[1:] if re.match(r"^#[A-Z]", line) else line
        if not assignment.strip() or assignment.startswith("#"):
            continue
        match = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=", assignment)
        assert match, f"line {number} is not KEY=VALUE: {line!r}"
        name = match.group(1)
        assert not name.startswith("ELASTICD_") or name in env_vars, f"line {number}: {name}"
