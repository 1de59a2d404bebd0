"""The raft timing of the embedded etcd: a lone member's short timer, a cluster's own."""

from __future__ import annotations

from elasticd.etcd.cluster import ClusterMember
from elasticd.etcd.embedded import SINGLE_MEMBER_HEARTBEAT_MS, EmbeddedEtcd


def _flag(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, cmd
    return cmd[cmd.index(flag) + 1]


def test_a_lone_member_elects_itself_on_a_short_timer(tmp_path):
    cmd = EmbeddedEtcd(str(tmp_path / "etcd"))._command()
    assert _flag(cmd, "--heartbeat-interval") == str(SINGLE_MEMBER_HEARTBEAT_MS) == "10"
    assert _flag(cmd, "--election-timeout") == "100"


def test_a_cluster_member_keeps_the_timing_it_was_given(tmp_path):
    member = ClusterMember("m0", str(tmp_path / "m0"), heartbeat_ms=50, election_ms=700)
    cmd = member._command()
    assert (_flag(cmd, "--heartbeat-interval"), _flag(cmd, "--election-timeout")) == ("50", "700")
