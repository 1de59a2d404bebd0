"""The agent and the worker API never import each other; the control package imports neither;
the checkpoint package never imports the worker API."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "elasticd"


def _imports(path: Path) -> set[str]:
    """Every module named by an import statement in ``path`` (function-level ones too)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("package, forbidden", [
    ("agent", ("elasticd.worker",)),
    ("worker", ("elasticd.agent",)),
    ("control", ("elasticd.agent", "elasticd.worker")),
    ("checkpoint", ("elasticd.worker",)),
])
def test_package_does_not_import(package, forbidden):
    """No module of the package imports a forbidden one, at any level of the file."""
    offenders = []
    for path in sorted((PKG / package).rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                offenders.append(f"{path.relative_to(PKG.parent)}: {name}")
    assert not offenders, "layering broken:\n" + "\n".join(offenders)


def test_checker_sees_function_level_imports(tmp_path):
    """The walk finds an import inside a function body (so it can fail)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from elasticd.agent.runner import run_node\n")
    assert "elasticd.agent.runner" in _imports(f)
