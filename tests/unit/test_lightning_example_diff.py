"""A Lightning script becomes elastic by changing at most 5 lines, and the docs show that diff."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from unit.test_ddp_tutorial_diff import changed_lines

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "lightning_plain.py"
ELASTIC = ROOT / "examples" / "lightning_elastic.py"
PAGE = ROOT / "docs" / "integrations" / "lightning.md"
MAX_CHANGED = 5


def test_lightning_example_changes_at_most_five_lines():
    """examples/lightning_elastic.py differs from the plain Lightning script in <= 5 lines."""
    before, after = PLAIN.read_text().splitlines(), ELASTIC.read_text().splitlines()
    assert len(before) > 60 and "L.Trainer(" in PLAIN.read_text()  # the whole script, not a stub
    n = changed_lines(before, after)
    assert 0 < n <= MAX_CHANGED, f"{n} changed lines:\n" + "\n".join(
        difflib.unified_diff(before, after, lineterm="", n=0))


def test_lightning_page_shows_exactly_this_diff():
    """docs/integrations/lightning.md's diff block is exactly the diff between the two files."""
    blocks = re.findall(r"```diff\n(.*?)```", PAGE.read_text(), re.S)
    want = list(difflib.unified_diff(PLAIN.read_text().splitlines(), ELASTIC.read_text().splitlines(),
                                     "examples/lightning_plain.py", "examples/lightning_elastic.py",
                                     lineterm="", n=1))
    assert len(blocks) == 1 and blocks[0].splitlines() == want
