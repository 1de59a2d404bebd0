"""How etcd's HTTP/JSON gateway answers become gRPC-shaped results and errors."""

from __future__ import annotations

import base64

import grpc
import pytest
from etcd3 import etcdrpc

from elasticd.etcd.gateway import GATEWAY_PATHS, GatewayRpcError, _error_of, _stream_message

pytestmark = pytest.mark.timeout(10)


def test_an_etcd_error_keeps_its_grpc_code_and_message():
    """etcd's error body (also under HTTP 404, as for a revoked lease) keeps gRPC's code."""
    err = _error_of('{"error":"etcdserver: requested lease not found","code":5,'
                    '"message":"etcdserver: requested lease not found"}', 404)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "lease not found" in err.details()
    assert isinstance(err, grpc.RpcError)


def test_a_body_that_is_not_etcds_is_unknown():
    """A proxy's HTML or plain text is an UNKNOWN failure carrying the HTTP status."""
    err = _error_of("<html>bad gateway</html>", 502)
    assert err.code() == grpc.StatusCode.UNKNOWN and "HTTP 502" in err.details()


def test_a_watch_message_parses_into_the_protobuf_response():
    """A streamed watch result (int64 as strings, bytes as base64, enums by name) parses
    into etcd3's WatchResponse, deletions typed as such."""
    key = base64.b64encode(b"/k").decode()
    line = ('{"result":{"header":{"revision":"7"},"watch_id":"0","events":'
            f'[{{"type":"DELETE","kv":{{"key":"{key}","mod_revision":"7"}}}}]}}}}\n').encode()
    msg = _stream_message(line, etcdrpc.WatchResponse)
    assert msg.header.revision == 7 and msg.events[0].kv.key == b"/k"
    assert msg.events[0].type == msg.events[0].DELETE


def test_a_stream_error_or_end_is_an_rpc_error():
    """An error message in a stream keeps its code; an ended stream is UNAVAILABLE."""
    with pytest.raises(GatewayRpcError) as err:
        _stream_message(b'{"error":{"grpc_code":9,"code":9,"message":"etcdserver: no leader"}}',
                        etcdrpc.WatchResponse)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(GatewayRpcError) as ended:
        _stream_message(b"", etcdrpc.WatchResponse)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE


def test_every_etcd_call_elasticd_makes_has_a_gateway_path():
    """The KV, lease, watch, alarm, status, leader-move and auth calls all map to a path."""
    for method in ("KV/Range", "KV/Put", "KV/DeleteRange", "KV/Txn", "Lease/LeaseGrant",
                   "Lease/LeaseRevoke", "Lease/LeaseKeepAlive", "Watch/Watch",
                   "Maintenance/Alarm", "Maintenance/Status", "Maintenance/MoveLeader",
                   "Auth/Authenticate"):
        assert GATEWAY_PATHS[f"/etcdserverpb.{method}"].startswith("/v3/")
