"""elasticd.worker.fast_exit in a real process: status, flushed output, no teardown."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = """\
import atexit, logging, sys
from elasticd import worker
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
atexit.register(lambda: open(sys.argv[1], "w").write("ran"))
print("buffered line")          # stdout is a pipe: block-buffered, not yet written
logging.getLogger("t").info("logged line")
worker.fast_exit(3)
print("never")
"""


def test_fast_exit_flushes_output_and_skips_teardown(tmp_path):
    """fast_exit(3): exit status 3, buffered stdout and logging flushed, atexit skipped."""
    marker = tmp_path / "atexit-ran"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker)], capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered line\n"
    assert "logged line" in proc.stderr
    assert not marker.exists(), "atexit handlers ran: the teardown was not skipped"
