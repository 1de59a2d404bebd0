"""EtcdClient over etcd's HTTP/JSON gateway (a forked child's transport, issue 52): every
operation elasticd makes, watches, errors and TLS, against a real etcd."""

from __future__ import annotations

import threading
import time

import pytest

from elasticd.errors import ConfigError, EtcdUnavailableError, LeaseLostError
from elasticd.etcd import EtcdClient, Get, ModRevision, Put, gateway
from elasticd.etcd.embedded import EmbeddedEtcd, free_port
from elasticd.etcd.gateway import GatewayEndpoint

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gateway_mode(monkeypatch):
    """This process acts as a fork child of a gRPC user: new clients use the gateway."""
    monkeypatch.setattr(gateway, "_fork_child", True)


def _wait_for(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_every_client_operation_works_over_the_gateway(etcd_server, gateway_mode):
    """Reads, writes, deletes, transactions (with reads), leases and alarms give over the
    gateway what they give over gRPC, and no gRPC endpoint is built."""
    c = EtcdClient(etcd_server.endpoint, timeout_s=5.0)
    try:
        c.put("/gw/a", "1")
        assert all(isinstance(ep, GatewayEndpoint) for ep in c.raw().endpoints.values())
        kv = c.get("/gw/a")
        assert kv is not None and kv.value == b"1" and kv.create_revision == kv.mod_revision > 0
        assert c.get("/gw/none") is None
        kvs, rev = c.get_prefix("/gw/")
        assert [k.key for k in kvs] == ["/gw/a"] and rev >= kv.mod_revision
        keys_only, _ = c.get_prefix("/gw/", keys_only=True)
        assert keys_only[0].value == b""
        ok, reads = c.txn_read([ModRevision("/gw/a", kv.mod_revision)],
                               [Put("/gw/b", b"\x00\xff"), Get("/gw/b")])
        assert ok and reads[0] is not None and reads[0].value == b"\x00\xff"
        assert c.txn([ModRevision("/gw/a", 1)], [Put("/gw/c", "x")]) is False
        assert c.get("/gw/c") is None
        assert c.count_prefix("/gw/") == 2
        lease = c.grant_lease(10)
        assert 0 < c.refresh_lease(lease) <= 10 and c.refresh_lease(lease, timeout_s=2) > 0
        c.put("/gw/leased", "x", lease=lease)
        assert c.get("/gw/leased").lease == lease
        c.revoke_lease(lease)
        c.revoke_lease(lease)  # already gone: fine, as over gRPC
        assert c.get("/gw/leased") is None
        assert c.refresh_lease(lease) <= 0
        with pytest.raises(LeaseLostError):
            c.put("/gw/x", "y", lease=lease)
        assert c.delete("/gw/a") is True and c.delete("/gw/a") is False
        c.delete_prefix("/gw/")
        assert c.count_prefix("/gw/") == 0
        assert c.alarms() == []
    finally:
        c.close()


def test_a_prefix_watch_over_the_gateway_delivers_and_survives_an_etcd_restart(etcd_server,
                                                                                 gateway_mode):
    """A PrefixWatch over the gateway gets its snapshot and each change once, in order; a
    watch cancelled on the shared stream stops while the other goes on; after etcd is killed
    and restarted the watch resumes and delivers a later change."""
    c = EtcdClient(etcd_server.endpoint, timeout_s=2.0)
    c.put("/w/0", "0")
    seen: list[tuple[str, bytes | None]] = []
    snapshots: list[int] = []
    lock = threading.Lock()

    def on_events(events):
        with lock:
            seen.extend((e.key, e.value) for e in events)

    watch = c.watch_prefix("/w/", on_events, lambda kvs, rev: snapshots.append(len(kvs)),
                           health_interval_s=0.5)
    other: list[str] = []
    watch2 = c.watch_prefix("/v/", lambda evs: other.extend(e.key for e in evs), lambda kvs, rev: None)
    try:
        assert watch.connected.wait(10) and watch2.connected.wait(10)
        assert snapshots == [1]
        c.put("/w/1", "a")
        c.delete("/w/0")
        c.put("/v/1", "b")
        assert _wait_for(lambda: len(seen) >= 2 and other == ["/v/1"]), (seen, other)
        assert seen == [("/w/1", b"a"), ("/w/0", None)]
        watch2.stop()
        etcd_server.kill()
        etcd_server.start()
        assert _wait_for(lambda: c.get("/w/1") is not None if _reachable(c) else False, 30)
        c.put("/w/2", "c")
        c.put("/v/2", "d")
        assert _wait_for(lambda: ("/w/2", b"c") in seen, 30), seen
        assert [k for k, _ in seen].count("/w/1") == 1
        assert other == ["/v/1"]
    finally:
        watch.stop()
        watch2.stop()
        c.close()


def _reachable(c: EtcdClient) -> bool:
    try:
        c.get("/")
        return True
    except EtcdUnavailableError:
        return False


def test_an_unreachable_etcd_is_transient_over_the_gateway(gateway_mode):
    """A gateway call to a port nobody serves raises EtcdUnavailableError (retry), as gRPC's."""
    c = EtcdClient(f"127.0.0.1:{free_port()}", timeout_s=1.0)
    try:
        with pytest.raises(EtcdUnavailableError):
            c.get("/x")
        assert c.unreachable()
    finally:
        c.close()


def test_an_etcd_without_a_gateway_is_refused_clearly(tmp_path, monkeypatch):
    """elasticd's private embedded etcd serves no gateway (its server certificate is no
    client one): a forked child's call fails with a ConfigError that says why and names
    the spawn/forkserver way out, not with an endless retry."""
    server = EmbeddedEtcd(str(tmp_path / "etcd"), private=True).start()
    try:
        monkeypatch.setattr(gateway, "_fork_child", True)
        c = EtcdClient(server.endpoint, timeout_s=2.0, tls=server.client_tls)
        with pytest.raises(ConfigError, match="no HTTP/JSON gateway.*spawn"):
            c.put("/k", "v")
        c.close()
    finally:
        server.stop(remove_data=True)
