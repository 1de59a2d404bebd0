"""Which gRPC failures mean "a socket from before a fork": retried once on fresh channels."""

from __future__ import annotations

import grpc
import pytest

from elasticd.etcd.client import stale_after_fork

pytestmark = pytest.mark.timeout(10)


class _RpcError(grpc.RpcError):
    """A gRPC failure as python3-etcd3 lets it through: a code and gRPC's details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_refused_socket_after_a_fork_is_stale():
    """gRPC's "Wrong file descriptor generation", raw or wrapped by python3-etcd3, is stale."""
    raw = _RpcError(grpc.StatusCode.UNAVAILABLE,
                    "Stream removed (sendmsg: Wrong file descriptor generation)")
    assert stale_after_fork(raw)
    try:
        try:
            raise raw
        except grpc.RpcError as exc:
            raise ConnectionError("etcd3 re-raised") from exc
    except ConnectionError as wrapped:
        assert stale_after_fork(wrapped)


@pytest.mark.parametrize("details", ["failed to connect to all addresses", "Deadline Exceeded",
                                     "Stream removed", "etcdserver: mvcc: database space exceeded"])
def test_other_failures_are_not_stale(details):
    """An unreachable or slow etcd is not mistaken for a stale socket (no extra attempt)."""
    assert not stale_after_fork(_RpcError(grpc.StatusCode.UNAVAILABLE, details))


def test_grpc_reconnects_at_least_every_second(monkeypatch):
    """gRPC's reconnect backoff is capped at 1 s (its default grows to 120 s: a client whose
    etcd was refused for 25 s stayed deaf 18 s after etcd answered again, and a member deaf
    after etcd's return was left out of the next round, soak seeds 74014 and 74018). The
    options are read where the client opens its channel."""
    from elasticd.etcd.client import RECONNECT_BACKOFF_MS, EtcdClient

    opened: list[dict] = []
    real = grpc.insecure_channel

    def recording(target, options=None, *args, **kwargs):
        opened.append(dict(options or []))
        return real(target, options, *args, **kwargs)

    monkeypatch.setattr(grpc, "insecure_channel", recording)
    client = EtcdClient("127.0.0.1:2379")
    try:
        client.raw()
    finally:
        client.close()
    (opts,) = opened
    assert opts["grpc.max_reconnect_backoff_ms"] == RECONNECT_BACKOFF_MS[1] <= 1000
    assert opts["grpc.initial_reconnect_backoff_ms"] == RECONNECT_BACKOFF_MS[0] <= 1000
