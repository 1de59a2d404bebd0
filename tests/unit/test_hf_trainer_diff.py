"""A Hugging Face Trainer script becomes elastic by changing at most 5 lines, and the docs show that diff."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from unit.test_ddp_tutorial_diff import changed_lines

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "hf_trainer.py"
ELASTIC = ROOT / "examples" / "hf_trainer_elastic.py"
PAGE = ROOT / "docs" / "integrations" / "transformers.md"
MAX_CHANGED = 5


def test_trainer_example_changes_at_most_five_lines_and_the_docs_show_them():
    """examples/hf_trainer_elastic.py differs from the plain Trainer script in <= 5 lines, and
    the first diff block of docs/integrations/transformers.md is exactly that diff."""
    before, after = PLAIN.read_text().splitlines(), ELASTIC.read_text().splitlines()
    assert "trainer = Trainer(" in PLAIN.read_text() and "trainer.train()" in PLAIN.read_text()
    n = changed_lines(before, after)
    assert 0 < n <= MAX_CHANGED, f"{n} changed lines"
    want = list(difflib.unified_diff(before, after, "examples/hf_trainer.py",
                                     "examples/hf_trainer_elastic.py", lineterm="", n=1))
    block = re.search(r"```diff\n(.*?)```", PAGE.read_text(), re.S)
    assert block is not None and block.group(1).splitlines() == want


def test_readme_points_at_the_page():
    """README.md links the Trainer integration's page."""
    assert "docs/integrations/transformers.md" in (ROOT / "README.md").read_text()
