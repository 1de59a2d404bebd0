"""SIGKILL a worker in the middle of a background upload: the previous checkpoint comes back.

The child process (this file run as a script) commits step 1, then starts an async save of
step 2 whose upload is held mid-file, says so on stdout, and is killed by the test.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading

import pytest
import torch
from integration.s3_fixture import S3_ENV, moto_s3, s3_root  # noqa: F401 - fixtures
from structlog.testing import capture_logs

from elasticd.checkpoint import CheckpointManager, list_checkpoints

N = 1 << 18  # 1 MiB of float32: torch.save writes it in one call, after a small header


def _child(url: str, options: dict) -> None:
    from elasticd.checkpoint import store as store_mod
    from elasticd.logs import configure_logging

    configure_logging("json")  # logs to stderr: stdout carries the handshake

    mgr = CheckpointManager(url, job="crash", storage_options=options)
    state = {"w": torch.ones(N)}
    mgr.save(1, state, blocking=True)
    real = store_mod._HashingWriter.write

    def held_write(self, data):
        n = real(self, data)
        if self.size > N // 2:
            print("UPLOADING", flush=True)
            threading.Event().wait()  # held mid-upload until SIGKILL
        return n

    store_mod._HashingWriter.write = held_write
    state["w"].fill_(2.0)
    mgr.save(2, state)
    mgr.wait()


@pytest.fixture(params=["file", "s3"])
def where(request, tmp_path):
    """(url, storage options) on a shared disk and on S3."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt", {}
    return request.getfixturevalue("s3_root")


@pytest.mark.timeout(90)
def test_sigkill_during_background_upload_keeps_previous_checkpoint(where):
    """A worker killed mid-upload leaves no loadable step 2: step 1 loads, torn data is skipped."""
    url, options = where
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **(S3_ENV if url.startswith("s3") else {}), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, __file__, url, json.dumps(options)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"UPLOADING":
            proc.kill()
            pytest.fail(f"child never started uploading: {line!r}\n{proc.stderr.read().decode()[-3000:]}")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    w = torch.zeros(N)
    with capture_logs() as cap:
        loaded = CheckpointManager(url, job="crash", storage_options=options).load_latest({"w": w})
    assert loaded.step == 1 and torch.all(w == 1.0)
    infos = list_checkpoints(url, "crash", storage_options=options)
    if url.startswith("file"):
        # The partial data file is on disk without a manifest; readers skipped it.
        assert [(i.step, i.valid) for i in infos] == [(2, False), (1, True)]
        assert any(e["event"] == "checkpoint_skipped" and "no manifest" in e["reason"] for e in cap)
    else:
        # S3 never shows an unfinished multipart upload: step 2 simply does not exist.
        assert [(i.step, i.valid) for i in infos] in ([(1, True)], [(2, False), (1, True)])


if __name__ == "__main__":
    _child(sys.argv[1], json.loads(sys.argv[2]))
