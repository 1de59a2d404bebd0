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
