"""A 3-member etcd cluster: the client rides through the death or freeze of its member.

python3-etcd3 never leaves an endpoint by itself (elasticd builds it with ``time_retry=0``),
so these pin elasticd's own fail-over: calls move to the next member, watches follow, and a
keep-alive stuck on a frozen member cannot outlast the lease.
"""

from __future__ import annotations

import time

import pytest
from harness import wait_until

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.lease import LeaseKeeper

pytestmark = pytest.mark.timeout(90)


def _member_in_use(cluster, client: EtcdClient) -> int:
    """Index of the member ``client`` currently talks to."""
    client.get("/probe")  # builds the channel
    label = client.raw()._current_endpoint_label
    return [m.endpoint for m in cluster.members].index(label)


def _put_eventually(client: EtcdClient, key: str, value: str, timeout_s: float) -> float:
    """Retry ``put`` until it succeeds; return how long that took."""
    t0 = time.monotonic()

    def ok() -> bool:
        try:
            client.put(key, value)
            return True
        except Exception:
            return False

    wait_until(ok, timeout_s, f"a put to {key} after the fault", interval_s=0.1)
    return time.monotonic() - t0


def test_cluster_has_one_leader_and_lists_every_member(etcd_cluster):
    """Three members agree on one leader; ``endpoints`` names all three client ports."""
    leader = etcd_cluster.wait_leader()
    statuses = [etcd_cluster.status(i) for i in range(3)]
    assert all(s is not None for s in statuses)
    assert {s.leader_id for s in statuses} == {statuses[leader].member_id}
    assert etcd_cluster.endpoints.split(",") == [m.endpoint for m in etcd_cluster.members]


def test_client_fails_over_when_its_member_is_killed(etcd_cluster):
    """SIGKILL of the member a client uses: its next calls reach another member within seconds."""
    client = EtcdClient(etcd_cluster.endpoints, timeout_s=1.0)
    try:
        victim = _member_in_use(etcd_cluster, client)
        etcd_cluster.kill(victim)
        took = _put_eventually(client, "/k", "v", 15)
        assert client.get("/k").value == b"v"
        assert took < 10, f"fail-over took {took:.1f}s"
    finally:
        client.close()


def test_watch_moves_off_a_frozen_member(etcd_cluster):
    """SIGSTOP of the member a watch streams from: the watch resumes on another member and
    delivers the next change (a quiet stream to a frozen member never fails by itself)."""
    client = EtcdClient(etcd_cluster.endpoints, timeout_s=1.0)
    other = None
    victim = 0
    seen: list[str] = []
    watch = client.watch_prefix("/w/", lambda evs: seen.extend(e.key for e in evs),
                                lambda kvs, rev: None)
    try:
        assert watch.connected.wait(10)
        victim = _member_in_use(etcd_cluster, client)
        etcd_cluster.freeze(victim)
        with pytest.raises(Exception):  # noqa: B017 - any failure: this call hits the frozen member
            client.get("/w/x")
        etcd_cluster.wait_leader(exclude=[victim])
        other = EtcdClient(",".join(m.endpoint for i, m in enumerate(etcd_cluster.members)
                                    if i != victim), timeout_s=2.0)
        _put_eventually(other, "/w/after", "1", 15)
        wait_until(lambda: "/w/after" in seen, 10, "the watch to deliver the change")
    finally:
        etcd_cluster.resume(victim)
        watch.stop(wait=False)
        client.close()
        if other is not None:
            other.close()


def test_keepalive_stuck_on_frozen_follower_does_not_lose_the_lease(etcd_cluster):
    """A lease of TTL 2 s kept alive through a client whose member froze (call timeout 3 s,
    longer than the TTL): keep-alives give up on the frozen member in TTL/3 and reach
    another before the lease expires; the leader (not frozen) never expires it."""
    leader = etcd_cluster.wait_leader()
    follower = next(i for i in range(3) if i != leader)
    client = EtcdClient(etcd_cluster.endpoints, timeout_s=3.0)
    probe = EtcdClient(etcd_cluster.members[leader].endpoint, timeout_s=2.0)
    keeper = None
    try:
        client.get("/probe")
        client.raw()._current_endpoint_label = etcd_cluster.members[follower].endpoint
        lease = client.grant_lease(2)
        probe.put("/lease-held", "1", lease=lease)
        keeper = LeaseKeeper(client, lease, 2).start()
        etcd_cluster.freeze(follower)
        t0 = time.monotonic()
        wait_until(lambda: time.monotonic() - t0 > 6, 10, "three TTLs with the member frozen",
                   interval_s=0.2)
        assert not keeper.lost.is_set()
        assert probe.get("/lease-held") is not None, "the lease expired while its node was healthy"
    finally:
        etcd_cluster.resume(follower)
        if keeper is not None:
            keeper.stop()
        client.close()
        probe.close()
