"""The ready-made configs in agents/ load with the real loader and fit their clouds."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.config import load_config, render_effective
from elasticd.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
AGENTS = sorted((REPO / "agents").glob("*.toml"))
# Seconds between a cloud's preemption notice and the machine going away.
NOTICE_WINDOW_S = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}


def load(path: Path, **kw):
    return load_config(str(path), {}, {}, hostname="node-a", **kw)


def test_the_documented_configs_exist():
    """agents/ holds the four configs the docs point to."""
    names = {p.name for p in AGENTS}
    assert {"single-machine.toml", "onprem-cluster.toml", "aws-spot.toml",
            "gcp-preemptible.toml"} <= names


@pytest.mark.parametrize("path", AGENTS, ids=lambda p: p.name)
def test_config_loads_and_renders(path):
    """Each config validates (files on the target machine aside) and renders for --check-config."""
    config = load(path, check_files=False)
    assert config.workers.command
    assert render_effective(config).startswith("# effective elasticd configuration")


@pytest.mark.parametrize("path", AGENTS, ids=lambda p: p.name)
def test_only_target_machine_files_are_missing(path):
    """With file checks on, the only possible complaint is a file that lives on the node."""
    try:
        load(path)
    except ConfigError as exc:
        assert "no such readable file" in str(exc) or "no such directory" in str(exc), exc


@pytest.mark.parametrize("path", AGENTS, ids=lambda p: p.name)
def test_drain_fits_the_preemption_notice(path):
    """A spot config's drain grace leaves at least 10 s of its cloud's notice for leaving."""
    config = load(path, check_files=False)
    provider = config.preemption.provider
    if provider in NOTICE_WINDOW_S:
        assert config.drain.grace_s + 10 <= NOTICE_WINDOW_S[provider]
        assert config.preemption.poll_interval_s <= NOTICE_WINDOW_S[provider] / 10


def test_multi_node_configs_use_a_shared_etcd():
    """Every config allowing several nodes names etcd endpoints (embedded etcd is local)."""
    for path in AGENTS:
        config = load(path, check_files=False)
        if config.job.max_nodes > 1:
            assert not config.etcd.embedded, path.name


@pytest.mark.parametrize("path", AGENTS, ids=lambda p: p.name)
def test_full_size_is_the_nnodes_maximum(path):
    """A multi-node config says how many nodes it is for ("# Full size: N nodes") and its
    nnodes maximum is that N: `elasticd status` calls anything below the maximum degraded."""
    import re

    config = load(path, check_files=False)
    if config.job.max_nodes == 1:
        return
    said = re.search(r"^# Full size: (\d+) nodes", path.read_text(), re.M)
    assert said, f"{path.name}: no '# Full size: N nodes' line above nnodes"
    assert int(said.group(1)) == config.job.max_nodes, path.name


def test_the_worked_four_machine_example_matches_the_onprem_config():
    """docs/deployment.md's worked example lists as many training machines as
    agents/onprem-cluster.toml's nnodes maximum: a healthy cluster there exits 0."""
    import re

    text = (REPO / "docs" / "deployment.md").read_text()
    start = text.index("## A worked example: four machines")
    section = text[start:text.index("\n## ", start + 1)]
    machines = re.findall(r"^\| (\S+) \| training node \|", section, re.M)
    config = load(REPO / "agents" / "onprem-cluster.toml", check_files=False)
    assert len(machines) == 4 and config.job.max_nodes == len(machines), machines
    assert "agents/onprem-cluster.toml" in section
