"""An agent's start-up imports no torch before its first standbys start (issue 14, join)."""

from __future__ import annotations

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
