"""docs/architecture.md's module table matches the code: one row per module under elasticd/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_ROW = re.compile(r"^\| `(elasticd(?:\.[A-Za-z0-9_]+)*)` \| (.+) \|$")


def _modules() -> set[str]:
    out = set()
    for path in (ROOT / "elasticd").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


@pytest.mark.timeout(10)
def test_the_module_table_names_every_module_once_and_nothing_else():
    """Every module (and package) under elasticd/ has exactly one row with a description,
    and every row names a module that exists: a module added, moved or removed without
    its line in docs/architecture.md fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("### Modules", 1)[1].split("\n## ", 1)[0]
    rows = [m for m in map(_ROW.match, table.splitlines()) if m]
    named = [m.group(1) for m in rows]
    assert len(named) == len(set(named)), "a module has two rows"
    assert all(m.group(2).strip() for m in rows)
    missing, extra = _modules() - set(named), set(named) - _modules()
    assert not missing, f"add a row to docs/architecture.md's module table for: {sorted(missing)}"
    assert not extra, f"no such module, remove its row: {sorted(extra)}"
