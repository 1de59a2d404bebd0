"""tests/conftest._test_tmpdir: a test with a tmp_path keeps its temp files, and the agents'
runtime dirs, under it (never the real /tmp, where a SIGKILLed agent's dir would stay)."""

from __future__ import annotations

import os
import tempfile

import pytest

from elasticd.control.server import ControlChannel


@pytest.mark.timeout(10)
def test_a_test_with_tmp_path_keeps_temp_files_and_its_childrens_under_it(tmp_path):
    """TMPDIR (what agents, etcds and workers inherit) and tempfile here point under tmp_path."""
    assert os.environ["TMPDIR"] == str(tmp_path / "t")
    assert tempfile.gettempdir() == str(tmp_path / "t")
    assert tempfile.mkdtemp(prefix="elasticd-").startswith(str(tmp_path / "t") + os.sep)


@pytest.mark.timeout(10)
def test_an_agents_control_runtime_dir_is_made_under_tmp_path(tmp_path):
    """The agent's control runtime dir (``elasticd-XXXXXXXX``) is made under tmp_path, with a
    socket path short enough for AF_UNIX."""
    channel = ControlChannel()
    assert channel.dir.parent == tmp_path / "t"
    assert len(channel.socket_path.encode()) < 108


@pytest.mark.timeout(10)
@pytest.mark.real_tmp
def test_a_real_tmp_test_keeps_the_real_temp_dir(tmp_path):
    """A test marked real_tmp (it checks what another uid can reach) is not redirected."""
    assert not tempfile.gettempdir().startswith(str(tmp_path))
