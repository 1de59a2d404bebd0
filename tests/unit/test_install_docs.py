"""The install commands that docs and recipes print can run: elasticd is not on PyPI.

`pip install elasticd` or `pip install 'elasticd[plot]'` (a package name, not a path to a
checkout or a wheel) fails for every user; and the torch range a page names is the one
the package requires (pyproject), not an older one.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"),
                *(p for d in ("deploy", "agents", "examples", "systemd")
                  for p in (REPO / d).rglob("*") if p.is_file())])
PIP_INSTALL = re.compile(r"\bpip3?\s+install\s+([^`\n#]*)")
PACKAGE_NAME = re.compile(r"elasticd(\[[\w,]*\])?")


def unpublished_installs(text: str) -> list[str]:
    """`pip install` commands in ``text`` that name elasticd as a package from an index."""
    found = []
    for m in PIP_INSTALL.finditer(text):
        try:
            words = shlex.split(m.group(1))
        except ValueError:
            words = m.group(1).split()
        if any(PACKAGE_NAME.fullmatch(w) for w in words):
            found.append(m.group(0).strip())
    return found


def test_the_check_sees_package_names_and_spares_paths():
    """The check can fail: a package name (quoted, with extras) is caught; a checkout, a
    wheel or '.[s3]' is not."""
    assert unpublished_installs("pip install elasticd   # or: pip install /src/elasticd")
    assert unpublished_installs("`pip install 'elasticd[plot]'`")
    assert unpublished_installs('  pip install "elasticd[s3]"')
    assert not unpublished_installs("pip install /opt/elasticd dist/elasticd-0.1.0-py3-none-any.whl")
    assert not unpublished_installs("pip install '.[s3]' && pip install \"/opt/elasticd[s3]\"")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_installs_elasticd_from_an_index(path):
    """No doc, recipe, config or example tells the user to `pip install elasticd`."""
    text = path.read_text(errors="replace")
    assert not unpublished_installs(text), f"{path.relative_to(REPO)}: {unpublished_installs(text)}"


def test_pages_name_the_torch_range_the_package_requires():
    """Every `torch>=...` a page names is pyproject's requirement (>=2.10,<2.15 today)."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (required,) = [d for d in deps if re.match(r"torch\b", d)]
    named = {(str(p.relative_to(REPO)), m) for p in PAGES
             for m in re.findall(r"torch\s*>=\s*[\d.]+(?:\s*,\s*<\s*[\d.]+)?", p.read_text(errors="replace"))}
    wrong = {(page, m) for page, m in named if m.replace(" ", "") != required}
    assert named and not wrong, wrong
