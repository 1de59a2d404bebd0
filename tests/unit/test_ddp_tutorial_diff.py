"""The DDP and FSDP2 tutorials become elastic by changing at most 10 lines, and the docs show that diff."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ROOT / "examples" / "ddp_tutorial.py"
ELASTIC = ROOT / "examples" / "ddp_tutorial_elastic.py"
LIVE = ROOT / "examples" / "ddp_tutorial_live.py"
FSDP_PLAIN = ROOT / "examples" / "fsdp_tutorial.py"
FSDP_ELASTIC = ROOT / "examples" / "fsdp_tutorial_elastic.py"
MAX_CHANGED = 10
MAX_LIVE_CHANGED = 5


def changed_lines(before: list[str], after: list[str]) -> int:
    """Lines changed: a replaced block counts its longer side, insertions and deletions
    their length (so editing one line counts 1, not 2)."""
    total = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        if tag != "equal":
            total += max(i2 - i1, j2 - j1)
    return total


def test_elastic_tutorial_changes_at_most_ten_lines():
    """examples/ddp_tutorial_elastic.py differs from the torchrun tutorial in <= 10 lines."""
    before, after = PLAIN.read_text().splitlines(), ELASTIC.read_text().splitlines()
    assert len(before) > 80  # the whole tutorial, not a stub
    n = changed_lines(before, after)
    assert 0 < n <= MAX_CHANGED, f"{n} changed lines:\n" + "\n".join(
        difflib.unified_diff(before, after, lineterm="", n=0))


def test_changed_lines_counts_edits_once():
    """The counter itself: one edited line is 1, one inserted and one deleted line are 2."""
    assert changed_lines(["a", "b", "c"], ["a", "B", "c"]) == 1
    assert changed_lines(["a", "b", "c"], ["x", "a", "c"]) == 2


def test_worker_api_page_leads_with_this_diff():
    """docs/worker-api.md's first diff block is exactly the diff between the two files."""
    doc = (ROOT / "docs" / "worker-api.md").read_text()
    block = re.search(r"```diff\n(.*?)```", doc, re.S)
    assert block is not None
    want = list(difflib.unified_diff(PLAIN.read_text().splitlines(), ELASTIC.read_text().splitlines(),
                                     "examples/ddp_tutorial.py", "examples/ddp_tutorial_elastic.py",
                                     lineterm="", n=1))
    assert block.group(1).splitlines() == want


def test_live_tutorial_adds_at_most_five_lines_and_the_docs_show_them():
    """examples/ddp_tutorial_live.py differs from the elastic tutorial in <= 5 lines, and
    docs/worker-api.md's second diff block is exactly that diff."""
    before, after = ELASTIC.read_text().splitlines(), LIVE.read_text().splitlines()
    n = changed_lines(before, after)
    assert 0 < n <= MAX_LIVE_CHANGED, f"{n} changed lines"
    blocks = re.findall(r"```diff\n(.*?)```", (ROOT / "docs" / "worker-api.md").read_text(), re.S)
    want = list(difflib.unified_diff(before, after, "examples/ddp_tutorial_elastic.py",
                                     "examples/ddp_tutorial_live.py", lineterm="", n=1))
    assert blocks[1].splitlines() == want


def test_fsdp_tutorial_changes_at_most_ten_lines_and_the_docs_show_them():
    """examples/fsdp_tutorial_elastic.py differs from the plain FSDP2 script in <= 10 lines,
    and the diff block of docs/worker-api.md that starts with the plain file is exactly it."""
    before, after = FSDP_PLAIN.read_text().splitlines(), FSDP_ELASTIC.read_text().splitlines()
    assert len(before) > 60 and "fully_shard" in FSDP_PLAIN.read_text()
    n = changed_lines(before, after)
    assert 0 < n <= MAX_CHANGED, f"{n} changed lines"
    want = list(difflib.unified_diff(before, after, "examples/fsdp_tutorial.py",
                                     "examples/fsdp_tutorial_elastic.py", lineterm="", n=1))
    blocks = re.findall(r"```diff\n(.*?)```", (ROOT / "docs" / "worker-api.md").read_text(), re.S)
    ours = [b for b in blocks if b.startswith("--- examples/fsdp_tutorial.py")]
    assert len(ours) == 1 and ours[0].splitlines() == want
