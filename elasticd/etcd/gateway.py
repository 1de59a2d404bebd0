"""etcd's HTTP/JSON gateway as a gRPC channel: how a forked child reaches etcd (issue 52).

A process forked from one whose gRPC was busy (a watch's polling thread is always inside
gRPC) inherits gRPC's process-wide state half-made: gRPC skips its fork reset, and a child
that opens a channel can abort in gRPC's poller (``ev_epoll1_linux.cc ... Check failed``) or
block. ``EtcdClient`` in such a child (``in_grpc_fork_child``) therefore never touches
gRPC: it hands python3-etcd3 a ``GatewayChannel`` instead of gRPC channels. The channel
answers the two calls python3-etcd3's generated stubs make (``unary_unary``,
``stream_stream``) with callables that send each protobuf request as JSON to etcd's gateway
(``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/lease/keepalive``, ``/v3/watch``, ...: on the
client port of every etcd >= 3.4) with the stdlib's ``http.client``, and parse the JSON
answer back into the protobuf response. Everything above the channel (python3-etcd3's
requests and responses, ``EtcdClient``'s retries, error translation and fail-over, the
``PrefixWatch``) is the same code as over gRPC; failures are raised as ``GatewayRpcError``,
a ``grpc.RpcError`` with gRPC's status code and etcd's message.

Transports, one interface: ``etcd3.Endpoint`` (gRPC, every process but a fork child) and
``GatewayEndpoint`` here. TLS: the same CA, client certificate and key as the gRPC path
(``ssl``; ``https://`` without a CA verifies against the system roots). Auth: python3-etcd3
authenticates through the channel and passes its token as call metadata, sent here as the
``Authorization`` header etcd's gateway reads.

Watches: etcd's gateway serves one watch per HTTP stream (a request body cannot be sent
while the answer streams), so a ``Watch`` call is a ``_WatchStream`` that opens one HTTP
stream per create request and merges their answers into one iterator, renumbering watch
ids per stream as gRPC's single stream numbers them; a cancel closes that watch's HTTP
stream. Like a gRPC stream, any one HTTP stream that breaks ends the whole ``Watch`` call
with an error (every watch on it is re-created by its ``PrefixWatch``).
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import queue
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import json_format

from elasticd.errors import ConfigError

# gRPC method -> the gateway's path (etcd's rpc.proto ``google.api.http`` options).
GATEWAY_PATHS = {
    "/etcdserverpb.KV/Range": "/v3/kv/range",
    "/etcdserverpb.KV/Put": "/v3/kv/put",
    "/etcdserverpb.KV/DeleteRange": "/v3/kv/deleterange",
    "/etcdserverpb.KV/Txn": "/v3/kv/txn",
    "/etcdserverpb.KV/Compact": "/v3/kv/compaction",
    "/etcdserverpb.Lease/LeaseGrant": "/v3/lease/grant",
    "/etcdserverpb.Lease/LeaseRevoke": "/v3/lease/revoke",
    "/etcdserverpb.Lease/LeaseKeepAlive": "/v3/lease/keepalive",
    "/etcdserverpb.Lease/LeaseTimeToLive": "/v3/lease/timetolive",
    "/etcdserverpb.Watch/Watch": "/v3/watch",
    "/etcdserverpb.Maintenance/Alarm": "/v3/maintenance/alarm",
    "/etcdserverpb.Maintenance/Status": "/v3/maintenance/status",
    "/etcdserverpb.Maintenance/MoveLeader": "/v3/maintenance/transfer-leadership",
    "/etcdserverpb.Auth/Authenticate": "/v3/auth/authenticate",
}
_CODES = {c.value[0]: c for c in grpc.StatusCode}
# A TLS handshake refused over a certificate fails the same way on every retry.
_TLS_REFUSED = re.compile(r"(?i)certificate|unknown_ca|wrong_version_number")
NO_GATEWAY = (
    "etcd at {where} serves no HTTP/JSON gateway (etcd older than 3.4, started with "
    "--enable-grpc-gateway=false, or elasticd's private embedded etcd, whose server certificate "
    "cannot be a client one): this process was forked from one that used etcd over gRPC and "
    "reaches etcd only through the gateway (docs/architecture.md#forks-and-grpc); start it "
    "with multiprocessing's 'spawn' or 'forkserver' method, or serve etcd's gateway")

_fork_child = False  # set in a child forked from a process that opened gRPC channels
_grpc_opened = False  # this process opened a gRPC channel to etcd


def note_grpc_opened() -> None:
    """Record that this process opened gRPC channels: its forked children use the gateway."""
    global _grpc_opened
    _grpc_opened = True


def in_grpc_fork_child() -> bool:
    """True in a process forked (at any depth) from one that opened gRPC channels to etcd:
    gRPC's inherited state may be broken there, so etcd is reached over the gateway."""
    return _fork_child


def _after_fork_in_child() -> None:
    global _fork_child
    _fork_child = _fork_child or _grpc_opened


os.register_at_fork(after_in_child=_after_fork_in_child)


class GatewayRpcError(grpc.RpcError):
    """A failed gateway call, shaped as gRPC's: ``code()`` and ``details()``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _tls_context(ca: bytes | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=ca.decode() if ca else None)
    if cert_file and key_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


class GatewayChannel:
    """A stand-in for ``grpc.Channel`` that reaches one etcd member over its HTTP gateway."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, timeout_s: float) -> None:
        self.host, self.port, self.tls, self.timeout_s = host, port, tls, timeout_s

    def connect(self, timeout_s: float | None) -> http.client.HTTPConnection:
        t = self.timeout_s if timeout_s is None else timeout_s
        if self.tls is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=t, context=self.tls)
        return http.client.HTTPConnection(self.host, self.port, timeout=t)

    def open(self, path: str, body: dict[str, Any], metadata: Any,
             timeout_s: float | None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """POST ``body`` to ``path``; the connection and the answer (status checked)."""
        headers = {"Content-Type": "application/json"}
        for k, v in metadata or ():
            if k == "token":
                headers["Authorization"] = v
        conn = self.connect(timeout_s)
        try:
            conn.request("POST", path, body=json.dumps(body), headers=headers)
            resp = conn.getresponse()
        except TimeoutError as exc:
            conn.close()
            raise GatewayRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{path}: {exc}") from exc
        except ssl.SSLError as exc:
            conn.close()
            if isinstance(exc, ssl.SSLCertVerificationError) or _TLS_REFUSED.search(str(exc)):
                raise ConfigError(
                    f"etcd at {self.host}:{self.port}: TLS {exc}; check --etcd-ca (etcd.ca_file: "
                    "the CA that signed etcd's server certificate) and --etcd-cert/--etcd-key "
                    "(etcd.cert_file/key_file: a client certificate signed by a CA that etcd "
                    "trusts)") from exc
            raise GatewayRpcError(grpc.StatusCode.UNAVAILABLE,
                                  f"{self.host}:{self.port}{path}: {type(exc).__name__}: {exc}") from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise GatewayRpcError(grpc.StatusCode.UNAVAILABLE,
                                  f"{self.host}:{self.port}{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status != 200:
            text = resp.read().decode(errors="replace")
            conn.close()
            if resp.status == 404 and not text.lstrip().startswith("{"):  # no route, no etcd error
                raise ConfigError(NO_GATEWAY.format(where=f"{self.host}:{self.port}"))
            raise _error_of(text, resp.status)
        return conn, resp

    def unary_unary(self, method: str, request_serializer: Any = None,
                    response_deserializer: Any = None, **_: Any) -> Callable[..., Any]:
        path = GATEWAY_PATHS.get(method, "")
        response_type = type(response_deserializer(b""))

        def call(request: Any, timeout: float | None = None, metadata: Any = None,
                 credentials: Any = None, **_: Any) -> Any:
            if not path:
                raise GatewayRpcError(grpc.StatusCode.UNIMPLEMENTED, f"{method}: not on etcd's gateway")
            conn, resp = self.open(path, _to_json(request), metadata, timeout)
            try:
                text = _read(resp, path, lambda: resp.read())
            finally:
                conn.close()
            return json_format.Parse(text, response_type(), ignore_unknown_fields=True)

        return call

    def stream_stream(self, method: str, request_serializer: Any = None,
                      response_deserializer: Any = None, **_: Any) -> Callable[..., Any]:
        path = GATEWAY_PATHS.get(method, "")
        response_type = type(response_deserializer(b""))

        def call(requests: Iterator[Any], timeout: float | None = None, metadata: Any = None,
                 credentials: Any = None, **_: Any) -> Iterator[Any]:
            if path == "/v3/watch":
                return _WatchStream(self, requests, metadata, response_type)
            return self._one_answer_each(path, requests, metadata, timeout, response_type)

        return call

    def _one_answer_each(self, path: str, requests: Iterator[Any], metadata: Any,
                         timeout: float | None, response_type: Any) -> Iterator[Any]:
        """A request stream answered once per request (lease keep-alives): one HTTP
        stream per request, its first answer."""
        for request in requests:
            conn, resp = self.open(path, _to_json(request), metadata, timeout)
            try:
                line = _read(resp, path, resp.readline)
            finally:
                conn.close()
            yield _stream_message(line, response_type)

    def unary_stream(self, method: str, **_: Any) -> Callable[..., Any]:
        return _unimplemented(method)

    def stream_unary(self, method: str, **_: Any) -> Callable[..., Any]:
        return _unimplemented(method)

    def close(self) -> None:
        """Nothing held: every call opens and closes its own connection."""


class GatewayEndpoint:
    """One etcd member reached over its gateway: what python3-etcd3 needs of its
    ``Endpoint`` (``netloc``, ``use``, ``fail``, ``is_failed``, ``close``)."""

    def __init__(self, host: str, port: int, *, tls: ssl.SSLContext | None, timeout_s: float) -> None:
        self.netloc = f"{host}:{port}"
        self.secure = tls is not None
        self._channel = GatewayChannel(host, port, tls, timeout_s)

    def use(self) -> GatewayChannel:
        return self._channel

    def fail(self) -> None:
        """Never marked failed (as the gRPC endpoints, built with ``time_retry=0``)."""

    def is_failed(self) -> bool:
        return False

    def close(self) -> None:
        self._channel.close()


def gateway_endpoints(endpoints: list[tuple[str, int]], *, secure: bool, ca: bytes | None,
                      cert_file: str | None, key_file: str | None,
                      timeout_s: float) -> list[GatewayEndpoint]:
    """The gateway endpoints of ``endpoints`` with the TLS settings of the gRPC path."""
    tls = _tls_context(ca, cert_file, key_file) if secure else None
    return [GatewayEndpoint(h, p, tls=tls, timeout_s=timeout_s) for h, p in endpoints]


def _unimplemented(method: str) -> Callable[..., Any]:
    """A call elasticd never makes over the gateway (snapshots): refused when called."""

    def call(*_: Any, **__: Any) -> Any:
        raise GatewayRpcError(grpc.StatusCode.UNIMPLEMENTED, f"{method}: not on etcd's gateway")

    return call


def _to_json(request: Any) -> dict[str, Any]:
    return json_format.MessageToDict(request, preserving_proto_field_name=True)


def _read(resp: http.client.HTTPResponse, path: str, read: Callable[[], bytes]) -> bytes:
    try:
        return read()
    except TimeoutError as exc:
        raise GatewayRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{path}: {exc}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise GatewayRpcError(grpc.StatusCode.UNAVAILABLE, f"{path}: {type(exc).__name__}: {exc}") from exc


def _error_of(text: str, http_status: int) -> GatewayRpcError:
    """etcd's error answer (``{"error": ..., "code": N, "message": ...}``) as gRPC's."""
    try:
        body = json.loads(text)
    except ValueError:
        return GatewayRpcError(grpc.StatusCode.UNKNOWN, f"HTTP {http_status}: {text[:200]}")
    body = body.get("error", body) if isinstance(body.get("error"), dict) else body
    code = _CODES.get(int(body.get("code", 2)), grpc.StatusCode.UNKNOWN)
    return GatewayRpcError(code, str(body.get("message") or body.get("error") or text[:200]))


def _stream_message(line: bytes, response_type: Any) -> Any:
    """One message of a gateway stream: ``{"result": {...}}`` or ``{"error": {...}}``."""
    if not line.strip():
        raise GatewayRpcError(grpc.StatusCode.UNAVAILABLE, "etcd's gateway closed the stream")
    body = json.loads(line)
    if "error" in body:
        err = body["error"]
        raise _error_of(json.dumps(err), 200)
    return json_format.ParseDict(body.get("result", {}), response_type(), ignore_unknown_fields=True)


class _WatchStream:
    """One gRPC ``Watch`` call over the gateway: an HTTP stream per watch, their answers
    merged into this iterator with per-call watch ids (see the module docstring)."""

    def __init__(self, channel: GatewayChannel, requests: Iterator[Any], metadata: Any,
                 response_type: Any) -> None:
        self._channel = channel
        self._metadata = metadata
        self._type = response_type
        self._out: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._conns: dict[int, http.client.HTTPConnection] = {}
        self._ids = itertools.count()
        self._closed = False
        threading.Thread(target=self._pump, args=(requests,), name="etcd-gateway-watch",
                         daemon=True).start()

    def __iter__(self) -> _WatchStream:
        return self

    def __next__(self) -> Any:
        item = self._out.get()
        if item is None:
            raise StopIteration
        if isinstance(item, BaseException):
            self._close_all()
            raise item
        return item

    def _pump(self, requests: Iterator[Any]) -> None:
        try:
            for rq in requests:
                which = rq.WhichOneof("request_union")
                if which == "create_request":
                    self._create(rq)
                elif which == "cancel_request":
                    self._cancel(int(rq.cancel_request.watch_id))
        except BaseException as exc:  # noqa: BLE001 - ends the call as a broken stream would
            self._out.put(GatewayRpcError(grpc.StatusCode.UNAVAILABLE, f"watch requests: {exc}"))
            return
        self._close_all()
        self._out.put(None)  # the caller closed its side: the call ends

    def _create(self, rq: Any) -> None:
        wid = next(self._ids)
        try:
            conn, resp = self._channel.open("/v3/watch", _to_json(rq), self._metadata, None)
        except GatewayRpcError as exc:
            self._out.put(exc)
            return
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns[wid] = conn
        threading.Thread(target=self._read, args=(wid, conn, resp), name=f"etcd-gateway-watch-{wid}",
                         daemon=True).start()

    def _read(self, wid: int, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        if conn.sock is not None:
            conn.sock.settimeout(None)  # a quiet watch is not an error (PrefixWatch checks it)
        try:
            while True:
                line = _read(resp, "/v3/watch", resp.readline)
                msg = _stream_message(line, self._type)
                msg.watch_id = wid
                self._out.put(msg)
        except Exception as exc:  # noqa: BLE001 - any end of a watch's stream
            with self._lock:
                cancelled = self._conns.pop(wid, None) is None or self._closed
            conn.close()
            if not cancelled:
                self._out.put(exc if isinstance(exc, grpc.RpcError)
                              else GatewayRpcError(grpc.StatusCode.UNAVAILABLE, f"watch: {exc}"))

    def _cancel(self, wid: int) -> None:
        with self._lock:
            conn = self._conns.pop(wid, None)
        if conn is not None:
            _shut(conn)

    def _close_all(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            _shut(conn)


def _shut(conn: http.client.HTTPConnection) -> None:
    """End a watch's HTTP stream from another thread (its reader wakes with an error)."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass
