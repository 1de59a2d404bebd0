"""Unit tests of elasticd.keys: job/node name validation and that keys never escape the prefix."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.errors import EX_CONFIG, ConfigError
from elasticd.keys import (
    ROOT,
    JobKeys,
    job_of_key,
    round_of_key,
    validate_job_name,
    validate_node_id,
)


@pytest.mark.parametrize("name", ["a", "demo", "my-run_1.v2", "A" * 64, "x.y", "..a", "a.."])
def test_valid_job_names_are_accepted(name):
    """Letters, digits, '-', '_' and '.' up to 64 characters form a valid job name."""
    assert validate_job_name(name) == name
    assert JobKeys(name).prefix == f"/elasticd/{name}/"


@pytest.mark.parametrize(
    "name",
    ["", "a/b", "/abs", "..", ".", "a" * 65, "jöb", "名前", "a b", "a\nb", "a\x00b", "a*", "a:b"],
)
def test_invalid_job_names_are_config_errors(name):
    """'/', '.', '..', 65 characters, unicode, spaces and control characters are refused."""
    with pytest.raises(ConfigError) as info:
        validate_job_name(name)
    assert info.value.exit_code == EX_CONFIG
    assert "invalid job name" in str(info.value) and "--job" in str(info.value)


def test_non_string_job_name_is_a_config_error():
    """A job name that is not a string (e.g. an int from TOML) is refused, not crashed on."""
    with pytest.raises(ConfigError):
        validate_job_name(7)  # type: ignore[arg-type]


def test_job_keys_rejects_invalid_name_at_construction():
    """JobKeys validates its job so no key of an invalid job can ever be built."""
    with pytest.raises(ConfigError):
        JobKeys("../other")


@pytest.mark.parametrize("node", ["", "a/b", "..", ".", "n" * 129, "nöde", "a b"])
def test_invalid_node_ids_are_config_errors(node):
    """Node ids with '/', '..', spaces, unicode or more than 128 characters are refused."""
    with pytest.raises(ConfigError):
        validate_node_id(node)
    with pytest.raises(ConfigError):
        JobKeys("demo").node(node)


def test_node_ids_allow_host_port_style():
    """A node id may contain ':' (host:port style ids) and be 128 characters long."""
    assert validate_node_id("host-1:29400") == "host-1:29400"
    assert validate_node_id("n" * 128) == "n" * 128


def _all_keys(k: JobKeys, node: str, round_: int, seq: int) -> list[str]:
    return [
        k.prefix, k.nodes_prefix, k.node(node), k.rdzv_prefix, k.rdzv_state, k.rdzv_closed,
        k.joins_root, k.joins_prefix(round_), k.join(round_, node), k.failures_root,
        k.failures_prefix(round_), k.failure(round_, node), k.store_root, k.store_prefix(round_),
        k.progress, k.checkpoint_latest, k.events_prefix, k.event(seq),
    ]


_JOB = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True).filter(lambda s: s not in (".", ".."))
_NODE = st.from_regex(r"[A-Za-z0-9_.:-]{1,128}", fullmatch=True).filter(lambda s: s not in (".", ".."))


@given(job=_JOB, node=_NODE, round_=st.integers(0, 10**9), seq=st.integers(0, 10**15))
def test_every_key_stays_under_its_job_prefix(job, node, round_, seq):
    """Every key built for a valid job starts with /elasticd/<job>/ and maps back to the job."""
    k = JobKeys(job)
    for key in _all_keys(k, node, round_, seq):
        assert key.startswith(f"{ROOT}{job}/")
        assert job_of_key(key) == job
        assert "//" not in key


@given(a=_JOB, b=_JOB)
def test_two_jobs_never_share_a_prefix(a, b):
    """No job's prefix is a prefix of another job's (a prefix watch/delete never spills over)."""
    if a != b:
        assert not JobKeys(a).prefix.startswith(JobKeys(b).prefix)


@given(round_=st.integers(0, 10**9), node=_NODE)
def test_round_is_parsed_back_from_per_round_keys(round_, node):
    """round_of_key recovers the round of join, failure and store keys."""
    k = JobKeys("demo")
    assert round_of_key(k.join(round_, node), k.joins_root) == round_
    assert round_of_key(k.failure(round_, node), k.failures_root) == round_
    assert round_of_key(k.store_prefix(round_) + "MASTER_ADDR", k.store_root) == round_


def test_round_keys_sort_in_round_order():
    """Zero-padded rounds sort lexically in numeric order (etcd range reads are by key)."""
    k = JobKeys("demo")
    keys = [k.joins_prefix(r) for r in (0, 2, 10, 100, 9)]
    assert sorted(keys) == [k.joins_prefix(r) for r in (0, 2, 9, 10, 100)]


def test_round_of_key_ignores_foreign_keys():
    """Keys outside the root or with a non-numeric round segment yield None."""
    k = JobKeys("demo")
    assert round_of_key("/elasticd/other/rdzv/joins/0000000001/a", k.joins_root) is None
    assert round_of_key(k.joins_root + "abc/n", k.joins_root) is None
    assert job_of_key("/other/demo/x") is None
    assert job_of_key(ROOT) is None
