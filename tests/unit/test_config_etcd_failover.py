"""`--check-config` warns when an agent is given one etcd endpoint (no member to fail over to)."""

from __future__ import annotations

from elasticd.config import load_config
from elasticd.config.checks import availability_warnings

BASE = {"job.name": "j", "workers.command": ("train.py",)}


def test_one_endpoint_is_warned_about_and_every_member_is_not():
    """One endpoint: a warning naming it and the fix; three endpoints or the embedded etcd: none."""
    one = load_config(None, {}, {**BASE, "etcd.endpoints": "etcd-1:2379"}, check_files=False)
    warnings = availability_warnings(one)
    assert len(warnings) == 1 and "etcd-1:2379" in warnings[0] and "list every member" in warnings[0]
    three = load_config(None, {}, {**BASE, "etcd.endpoints": "e1:2379,e2:2379,e3:2379"},
                        check_files=False)
    assert availability_warnings(three) == []
    embedded = load_config(None, {}, {**BASE, "job.standalone": True}, check_files=False)
    assert availability_warnings(embedded) == []


def test_node_ttl_must_outlast_a_leader_stall_without_election():
    """node.ttl_s below 1.5 x etcd.election_timeout_s is a ConfigError naming both keys and
    the TTL to use; below 3 x it --check-config warns; the defaults (5 s, 1 s) pass silently."""
    import pytest

    from elasticd.errors import ConfigError

    three = "e1:2379,e2:2379,e3:2379"
    with pytest.raises(ConfigError) as err:
        load_config(None, {}, {**BASE, "etcd.endpoints": three, "etcd.election_timeout_s": "5",
                               "node.ttl_s": "5"}, check_files=False)
    msg = str(err.value)
    assert "node.ttl_s = 5" in msg and "etcd.election_timeout_s = 5" in msg and "node.ttl_s >= 15" in msg
    tight = load_config(None, {}, {**BASE, "etcd.endpoints": three, "etcd.election_timeout_s": "3",
                                   "node.ttl_s": "5"}, check_files=False)
    warnings = availability_warnings(tight)
    assert len(warnings) == 1 and "node.ttl_s >= 9" in warnings[0]
    default = load_config(None, {}, {**BASE, "etcd.endpoints": three}, check_files=False)
    assert default.etcd.election_timeout_s == 1.0 and availability_warnings(default) == []
