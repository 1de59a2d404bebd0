"""Modules split by seam, not by count: a class lives in one file, and no class borrows
another's attributes (STYLE.md, "Layout shows the architecture").

This replaces the old "every module under 500 lines" habit, which split classes into
mixins that re-declared the agent's attributes to get under the count. Two cheap,
static checks over ``elasticd/``:

- no class name is defined at the top level of two modules (one name, one idea: a
  reader who sees ``StepReport`` knows which file holds it);
- no plain class declares instance attributes it never assigns (``handler:
  EtcdRendezvousHandler`` in the class body, set by whoever inherits it): that is a
  mixin re-declaring another class's state. Dataclasses, NamedTuples, TypedDicts,
  enums and Protocols declare fields by annotation, and a class that assigns the
  attribute itself (``self.x = ...``) owns it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "elasticd"

# Field-declaring kinds: an annotation in their body is a field, not a borrowed attribute.
_FIELD_BASES = ("Protocol", "NamedTuple", "TypedDict", "Enum", "IntEnum", "StrEnum")

# The agent's two mixins, removed by issue 22 item 1 (composed collaborators with
# constructors instead). Empty this once that lands: the test then holds for every class.
KNOWN_MIXINS: set[tuple[str, str]] = set()


def _classes(root: Path) -> list[tuple[str, ast.ClassDef]]:
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        out += [(path.relative_to(root).as_posix(), n) for n in tree.body
                if isinstance(n, ast.ClassDef)]
    return out


def duplicate_class_names(root: Path) -> dict[str, list[str]]:
    """Top-level class names defined in more than one module under ``root``."""
    where: dict[str, list[str]] = defaultdict(list)
    for rel, cls in _classes(root):
        where[cls.name].append(rel)
    return {name: files for name, files in where.items() if len(files) > 1}


def _declares_fields(cls: ast.ClassDef) -> bool:
    names = [ast.unparse(d) for d in cls.decorator_list] + [ast.unparse(b) for b in cls.bases]
    return any("dataclass" in n or n.split(".")[-1].split("[")[0] in _FIELD_BASES for n in names)


def borrowed_attributes(cls: ast.ClassDef) -> list[str]:
    """Attributes ``cls`` declares in its body (annotation, no value) but never assigns."""
    if _declares_fields(cls):
        return []
    declared = [s.target.id for s in cls.body
                if isinstance(s, ast.AnnAssign) and s.value is None and isinstance(s.target, ast.Name)]
    assigned = {t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign)
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return [a for a in declared if a not in assigned]


def mixins(root: Path) -> dict[tuple[str, str], list[str]]:
    """(module, class) -> the attributes it borrows, for every such class under ``root``."""
    out = {}
    for rel, cls in _classes(root):
        borrowed = borrowed_attributes(cls)
        if borrowed:
            out[(rel, cls.name)] = borrowed
    return out


def test_a_class_name_lives_in_one_module():
    """No two modules of elasticd define a top-level class of the same name."""
    dupes = duplicate_class_names(PKG)
    assert not dupes, f"one class name, one module: {dupes}"


def test_no_class_borrows_another_classes_attributes():
    """No class declares attributes that only a subclass sets (the mixin split)."""
    found = mixins(PKG)
    new = {k: v for k, v in found.items() if k not in KNOWN_MIXINS}
    assert not new, ("a class declares attributes it never sets (a mixin that re-declares "
                     f"another class's state); compose a collaborator instead: {new}")
    gone = KNOWN_MIXINS - set(found)
    assert not gone, f"remove {sorted(gone)} from KNOWN_MIXINS: they are no longer mixins"


def test_the_checks_can_fail(tmp_path):
    """A mixin and a class defined twice are found (so the checks above can fail)."""
    (tmp_path / "a.py").write_text(
        "class Care:\n    handler: object\n    def go(self):\n        return self.handler\n"
        "class Owner:\n    handler: object\n    def __init__(self):\n        self.handler = 1\n"
        "from dataclasses import dataclass\n@dataclass\nclass Rec:\n    x: int\n")
    (tmp_path / "b.py").write_text("class Care:\n    pass\n")
    assert duplicate_class_names(tmp_path) == {"Care": ["a.py", "b.py"]}
    assert mixins(tmp_path) == {("a.py", "Care"): ["handler"]}
