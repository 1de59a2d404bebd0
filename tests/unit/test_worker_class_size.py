"""Every class in elasticd/worker/ stays at most 300 lines (split by responsibility, issue 47)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import elasticd.worker

MAX_CLASS_LINES = 300
WORKER = Path(elasticd.worker.__file__).parent


def class_lengths(root: Path) -> dict[str, int]:
    """Lines of every class under ``root`` (decorators to last line), by ``path::Class``."""
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                assert node.end_lineno is not None
                out[f"{path.relative_to(root.parent)}::{node.name}"] = node.end_lineno - first + 1
    return out


@pytest.mark.timeout(30)
def test_no_worker_class_is_over_300_lines():
    """No class in elasticd/worker/ is longer than 300 lines."""
    lengths = class_lengths(WORKER)
    assert "worker/live.py::LiveState" in lengths  # the walk found the package's classes
    over = {name: n for name, n in lengths.items() if n > MAX_CLASS_LINES}
    assert not over, f"classes over {MAX_CLASS_LINES} lines (split them by responsibility): {over}"


@pytest.mark.timeout(30)
def test_class_lengths_count_decorators_and_bodies(tmp_path):
    """The walk measures a class from its first decorator to its last line, nested packages included."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "m.py").write_text(
        "import dataclasses\n\n@dataclasses.dataclass\nclass A:\n    x: int = 0\n    y: int = 1\n")
    assert class_lengths(tmp_path / "pkg") == {"pkg/sub/m.py::A": 4}
