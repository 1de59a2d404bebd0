"""A hardened etcd v3 client: the only module that talks to python3-etcd3.

python3-etcd3 0.13.0 is a thin gRPC wrapper with sharp edges for a daemon that must
run for weeks through etcd restarts. This module keeps every work-around in one place:

- A connection error marks an endpoint "failed" for 300 s by default, so every call
  raises ``ValueError: Trying to use a failed node`` long after etcd is back. We build
  endpoints with ``time_retry=0`` and fail over between them.
- ``etcd3/watch.py`` uses ``six`` without importing it, so a dropped watch stream kills
  the watch thread silently. watch.py patches the name in, and ``PrefixWatch`` there
  re-creates its watch from the last seen revision + 1 whenever the stream dies.
- Calls without a timeout can block forever: every call carries ``timeout_s``.
- Leases are not kept alive by the library: ``LeaseKeeper`` (lease.py) does it.
- Auth tokens expire: on an auth error the underlying client is rebuilt (re-auth).

Every error leaving this module is either ``EtcdUnavailableError`` (transient: retry;
its subclass ``EtcdNoSpaceError`` when etcd raised its NOSPACE alarm and refuses writes
until an operator compacts, defragments and disarms), ``ConfigError`` (bad endpoints, TLS
files or credentials, a wrong password: fix the config) or a plain result (a failed
transaction returns ``False``).

Transactions are described with the typed compares and operations of ``txn.py``; only
this module turns them into python3-etcd3 objects. Endpoint parsing and TLS files live in
``endpoints.py``, the records it returns (``KV``, ``WatchEvent``) in ``kv.py``.

Trust rules (docs/security.md): credentials are never sent in plaintext unless the
caller says ``allow_plaintext_auth=True`` (the loudly named config flag); an ``https://``
endpoint always means TLS, verified against gRPC's default roots when no CA is given.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import etcd3
import etcd3.exceptions
import grpc
import structlog

from elasticd.errors import ConfigError, EtcdNoSpaceError, EtcdUnavailableError, LeaseLostError
from elasticd.etcd.endpoints import TLSFiles, endpoints_scheme, parse_endpoints, read_tls_file
from elasticd.etcd.gateway import gateway_endpoints, in_grpc_fork_child, note_grpc_opened
from elasticd.etcd.kv import KV, WatchEvent, kv_map
from elasticd.etcd.lease import LeaseKeeper
from elasticd.etcd.txn import Compare, DeletePrefix, ModRevision, Op, Put, raw_compare, raw_op
from elasticd.etcd.watch import (
    WATCH_HEALTH_INTERVAL_S,
    PrefixWatch,
    StreamClosedError,
    WatchHandle,
    cancel_on,
)

if TYPE_CHECKING:
    from elasticd.config.model import EtcdConfig

log = structlog.get_logger(__name__)

_TRANSIENT_ETCD3 = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
    etcd3.exceptions.NoServerAvailableError,
    etcd3.exceptions.WatchTimedOut,
)
_TRANSIENT_GRPC = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
SLOW_CALL_S = 1.0
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_AUTH_GRPC = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
# A TLS handshake refused over a certificate will fail the same way on every retry.
_TLS_REJECTED = re.compile(r"(?i)handshake failed.*(certificate|unknown_ca|wrong_version_number)")
# etcd's answers to a wrong user or password, and to credentials sent to an etcd without
# auth: an operator must fix the config; retrying cannot help.
_AUTH_REFUSED = re.compile(r"(?i)authentication failed|invalid user ID or password|"
                           r"authentication is not enabled|user name (is )?empty|user name not found")
# etcd's quota error: the backend database hit --quota-backend-bytes and the NOSPACE alarm
# is raised; every write fails until compaction + defragmentation + `alarm disarm`.
_NOSPACE = re.compile(r"(?i)database space exceeded|NOSPACE")
# gRPC in a process forked while the parent's gRPC was busy: sendmsg() refused a socket
# (fds carry the fork generation they were made in), the request never left.
_STALE_AFTER_FORK = re.compile(r"Wrong file descriptor generation")
# gRPC's reconnect backoff (ms): first attempt after, and at most between two attempts.
RECONNECT_BACKOFF_MS = (200, 1000)
# A watch create finds its stream closed (replaced) at most this many times in a row.
_WATCH_CREATE_TRIES = 3
NOSPACE_FIX = ("etcd raised its NOSPACE alarm (database space exceeded) and refuses writes: "
               "compact and defragment etcd, then `etcdctl alarm disarm` "
               "(docs/deployment.md#etcd-space-compaction-and-nospace)")


def _grpc_detail(exc: BaseException) -> str:
    """gRPC's own reason for a failure (python3-etcd3 re-raises it as a bare exception)."""
    for candidate in (exc, exc.__context__):
        if isinstance(candidate, grpc.RpcError) and hasattr(candidate, "details"):
            return str(candidate.details() or "")
    return str(exc)


def stale_after_fork(exc: BaseException) -> bool:
    """True if ``exc`` is gRPC refusing a socket after a fork ("Wrong file descriptor
    generation"): nothing was sent, and the call succeeds again on fresh channels."""
    return bool(_STALE_AFTER_FORK.search(_grpc_detail(exc)))


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _TRANSIENT_ETCD3):
        return True
    if isinstance(exc, ValueError) and "failed node" in str(exc):
        return True
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if hasattr(exc, "code") else None
        return code in _TRANSIENT_GRPC
    return False


class EtcdClient:
    """Thread-safe etcd v3 client with bounded calls and transient-error translation.

    Args:
        endpoints: ``"host:port[,host:port...]"`` or a list of them.
        timeout_s: deadline of every single call.
        tls: TLS files; when set, all endpoints use TLS.
        user, password: etcd auth (both or neither).
        allow_plaintext_auth: send ``user``/``password`` without TLS. Off by default: a
            password on the wire in clear text is readable by anyone on the path.

    TLS is on when ``tls`` names a file or the endpoints are written ``https://``;
    ``https://`` without a CA file verifies etcd against gRPC's default root CAs.

    Raises:
        ConfigError: malformed endpoints, unreadable TLS files, half-given credentials,
            credentials without TLS (unless ``allow_plaintext_auth``).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout_s: float = 5.0,
        tls: TLSFiles | None = None,
        user: str | None = None,
        password: str | None = None,
        allow_plaintext_auth: bool = False,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        self.tls = tls or TLSFiles()
        self.secure = self.tls.enabled or endpoints_scheme(endpoints) == "https"
        if (user is None) != (password is None):
            raise ConfigError("etcd auth needs both a user and a password (or password_file)")
        if user is not None and not self.secure and not allow_plaintext_auth:
            raise ConfigError(
                f"etcd user {user!r} with a password but without TLS: the password would cross "
                "the network in clear text; serve etcd over TLS and set the CA (etcd.ca_file / "
                "--etcd-ca, or write the endpoints https://), or, on a network you trust, opt in "
                "with etcd.insecure_allow_plaintext_auth = true / --etcd-insecure-plaintext-auth"
            )
        self._user, self._password = user, password
        self._tls_material = self._read_tls()
        self._creds: grpc.ChannelCredentials | None = None  # built with the first gRPC channel
        # Reentrant: raw() translates a failed authentication while holding it, and the
        # translation drops the client under the same lock (a plain Lock deadlocked there).
        self._lock = threading.RLock()
        self._raw: etcd3.MultiEndpointEtcd3Client | None = None
        self._raw_pid = os.getpid()  # the process that built _raw
        self._closed = False
        # monotonic time of the last sign of etcd trouble: an error, or a call slower than
        # SLOW_CALL_S (a frozen etcd answers late). Lets callers tell "etcd was away" from
        # "we were away" when leases expire.
        self.last_trouble_at = -1e9
        # The outcome of the latest call: lets a caller whose deadline passed while etcd was
        # away say "etcd unreachable" rather than "timed out".
        self.last_ok_at = -1e9
        self.last_error = ""
        self._watches: weakref.WeakSet[PrefixWatch] = weakref.WeakSet()
        self._switch_logged_at = -1e9

    @classmethod
    def from_config(cls, e: EtcdConfig, *, endpoints: str | None = None,
                    tls: TLSFiles | None = None) -> EtcdClient:
        """The client of an ``[etcd]`` section: the one way the agent, its early arrival,
        its stop check and torchrun's handler connect (so a key reaches all of them).

        Args:
            e: the validated section (its password file is read here if not resolved yet).
            endpoints, tls: an embedded etcd's address and client certificate, instead of
                the configured ones.

        Raises:
            ConfigError: as the constructor (malformed endpoints, unreadable files, ...).
        """
        return cls(endpoints or ",".join(e.endpoints), timeout_s=e.timeout_s,
                   tls=tls or TLSFiles(e.ca_file, e.cert_file, e.key_file), user=e.user,
                   password=e.resolved_password(),
                   allow_plaintext_auth=e.insecure_allow_plaintext_auth)

    # -- plumbing ---------------------------------------------------------------------
    def _read_tls(self) -> tuple[bytes | None, bytes | None, bytes | None] | None:
        """The CA, client certificate and key (read and checked now), None without TLS."""
        if not self.secure:
            return None
        if bool(self.tls.cert_file) != bool(self.tls.key_file):
            raise ConfigError("etcd TLS: cert_file and key_file must be given together")
        ca = read_tls_file(self.tls.ca_file, "CA file") if self.tls.ca_file else None
        cert = read_tls_file(self.tls.cert_file, "client certificate") if self.tls.cert_file else None
        key = read_tls_file(self.tls.key_file, "client key") if self.tls.key_file else None
        return ca, cert, key

    def _build(self) -> etcd3.MultiEndpointEtcd3Client:
        eps: list[Any]
        if in_grpc_fork_child():
            # Forked from a process whose gRPC was in use: never touch gRPC here (gateway.py).
            eps = gateway_endpoints(self.endpoints, secure=self.secure,
                                    ca=self._tls_material[0] if self._tls_material else None,
                                    cert_file=self.tls.cert_file, key_file=self.tls.key_file,
                                    timeout_s=self.timeout_s)
        else:
            if self._tls_material is not None and self._creds is None:
                ca, cert, key = self._tls_material
                self._creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                                           certificate_chain=cert)
            # gRPC refuses replies over 4 MB by default; a 5,000-node job's status read is bigger.
            # Its reconnect backoff grows to 120 s by default: with connections refused for
            # 25 s (a proxy in front of a live etcd), a client stayed deaf for 18 s after they
            # were accepted again (0.2 s with these options), and a member deaf after etcd's
            # return was left out of the next round (soak seeds 74014, 74018). One reconnect
            # attempt a second at most costs etcd nothing.
            opts: Any = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                         ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                         ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                         ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])]
            eps = [
                etcd3.Endpoint(host, port, secure=self._creds is not None, creds=self._creds,
                               time_retry=0, opts=opts)
                for host, port in self.endpoints
            ]
            note_grpc_opened()
        self._raw_pid = os.getpid()
        return etcd3.MultiEndpointEtcd3Client(
            eps, timeout=self.timeout_s, user=self._user, password=self._password, failover=True
        )

    def raw(self) -> etcd3.MultiEndpointEtcd3Client:
        """The underlying python3-etcd3 client, built on first use (authenticates)."""
        with self._lock:
            if self._closed:
                raise EtcdUnavailableError("etcd client is closed")
            if self._raw is not None and self._raw_pid != os.getpid():
                # Made before a fork: its channels belong to the parent's gRPC. Left
                # unclosed (closing touches that gRPC state); this process builds its own.
                self._raw = None
            if self._raw is None:
                try:
                    self._raw = self._build()
                except Exception as exc:  # auth happens in the constructor
                    raise self._translate(exc) from exc
            return self._raw

    def _translate(self, exc: BaseException) -> Exception:
        if isinstance(exc, (EtcdUnavailableError, ConfigError, LeaseLostError)):
            return exc
        detail = _grpc_detail(exc)
        if isinstance(exc, grpc.RpcError) and _AUTH_REFUSED.search(detail):
            with self._lock:
                self._raw = None
            return ConfigError(
                f"etcd at {self.endpoint_label()} refused the credentials ({detail}): check "
                "etcd.user and the password (etcd.password_file / --etcd-password-file), and that "
                "auth is enabled on etcd"
            )
        if _NOSPACE.search(detail):
            return EtcdNoSpaceError(f"etcd at {self.endpoint_label()}: NOSPACE: {NOSPACE_FIX}")
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") and exc.code() in _AUTH_GRPC:
            with self._lock:
                self._raw = None  # token expired or revoked: re-authenticate next call
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if "token" in (details or "").lower():
                return EtcdUnavailableError(f"etcd auth token expired ({details}); re-authenticating")
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                return ConfigError(
                    f"etcd denied the request ({details}): the role of etcd.user must grant "
                    "readwrite on the job's prefix /elasticd/<job>/ (docs/deployment.md)"
                )
            return ConfigError(
                f"etcd refused the credentials ({details}): check etcd.user and etcd.password"
            )
        if (isinstance(exc, grpc.RpcError) and hasattr(exc, "code")
                and exc.code() == grpc.StatusCode.NOT_FOUND and "lease" in (exc.details() or "")):
            # A write on an expired lease: this node was away longer than its TTL.
            return LeaseLostError(f"etcd lease not found ({exc.details()}): this node's lease expired")
        if _is_transient(exc):
            where = ",".join(f"{h}:{p}" for h, p in self.endpoints)
            detail = _grpc_detail(exc)
            rejected = _TLS_REJECTED.search(detail)
            if rejected:
                reason = detail[rejected.start():].removesuffix(": OK")
                return ConfigError(
                    f"etcd at {where}: TLS {reason}; check --etcd-ca (etcd.ca_file: the CA "
                    "that signed etcd's server certificate) and --etcd-cert/--etcd-key "
                    "(etcd.cert_file/key_file: a client certificate signed by a CA that etcd trusts)"
                )
            hint = ""
            if "socket closed" in detail.lower():
                hint = (f" (if etcd serves TLS, pass {_TLS_FLAGS})" if not self.secure
                        else f" (if etcd does not serve TLS, drop {_TLS_FLAGS})")
            return EtcdUnavailableError(f"etcd at {where} unreachable: {type(exc).__name__}: "
                                        f"{detail}{hint}")
        return exc if isinstance(exc, Exception) else RuntimeError(str(exc))

    def call(self, fn: Callable[[etcd3.MultiEndpointEtcd3Client], Any]) -> Any:
        """Run ``fn(raw_client)`` and translate its errors (see module docstring)."""
        start = time.monotonic()
        raw: etcd3.MultiEndpointEtcd3Client | None = None
        used = None
        try:
            raw = self.raw()
            used = raw._current_endpoint_label
            try:
                result = fn(raw)
            except Exception as exc:
                if not stale_after_fork(exc):
                    raise
                # A process forked from one whose gRPC was busy (gRPC skipped its fork reset:
                # a watch's polling thread is always inside it) can find its first socket
                # refused: the request never left. Once more, on fresh channels; 11-27 % of
                # such children failed here before (benchmarks/fork_probe.py).
                self.drop_channels()
                raw = self.raw()
                used = raw._current_endpoint_label
                result = fn(raw)
            self.last_ok_at = time.monotonic()
            return result
        except Exception as exc:
            err = self._translate(exc)
            if isinstance(err, EtcdUnavailableError):
                self.last_trouble_at = time.monotonic()
                self.last_error = str(err)
                self._fail_over(raw, used)
            raise err from exc
        finally:
            if time.monotonic() - start > SLOW_CALL_S:
                self.last_trouble_at = time.monotonic()

    def _fail_over(self, raw: etcd3.MultiEndpointEtcd3Client | None, used: Any) -> None:
        """Point the next call at the next endpoint after one failed transiently.

        python3-etcd3 moves off an endpoint only once it is marked failed, and with
        ``time_retry=0`` (see the module docstring) none ever is: without this a client whose
        member died or froze would retry that member forever while the others serve.
        Only the first of several concurrent failures on one endpoint moves on.
        """
        if raw is None or len(raw.endpoints) < 2:
            return
        with self._lock:
            if raw._current_endpoint_label != used:
                return  # another thread already moved on
            labels = list(raw.endpoints)
            nxt = labels[(labels.index(used) + 1) % len(labels)] if used in labels else labels[0]
            raw._current_endpoint_label = nxt
            watches = list(self._watches)
            # One line per outage, not per retry: log only the first switch after a success.
            first = self.last_ok_at > self._switch_logged_at
            if first:
                self._switch_logged_at = time.monotonic()
        if first:
            log.info("etcd_endpoint_switched", failed=used, next=nxt)
        # A watch stream on a frozen or cut-off member never fails by itself, it goes quiet:
        # move every watch to the new endpoint (each resumes from its last revision + 1).
        for watch in watches:
            watch.reconnect()

    def alarms(self) -> list[str]:
        """The names of etcd's active alarms (``NOSPACE``, ``CORRUPT``), empty when none."""

        def read(c: etcd3.MultiEndpointEtcd3Client) -> list[str]:
            names = {0: "NONE", 1: "NOSPACE", 2: "CORRUPT"}
            return sorted({names.get(int(a.alarm_type), str(a.alarm_type))
                           for a in c.list_alarms()} - {"NONE"})

        return self.call(read)

    def trouble_within(self, seconds: float) -> bool:
        """True if etcd failed or answered slowly within the last ``seconds``."""
        return time.monotonic() - self.last_trouble_at < seconds

    def unreachable(self) -> str | None:
        """The error of the latest call if it found etcd unreachable, else None."""
        return self.last_error if self.last_trouble_at > self.last_ok_at and self.last_error else None

    def drop_channels(self) -> None:
        """Close the gRPC channels (ending their streams); the next call opens new ones."""
        with self._lock:
            raw, self._raw = self._raw, None
        if raw is not None and self._raw_pid == os.getpid():  # never a parent's channels
            try:
                raw.close()
            except Exception:  # closing a dead channel may raise; nothing to do
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.drop_channels()

    # -- KV ---------------------------------------------------------------------------
    @staticmethod
    def _kv(value: bytes, meta: Any) -> KV:
        return KV(
            key=meta.key.decode(),
            value=value,
            mod_revision=meta.mod_revision,
            create_revision=meta.create_revision,
            lease=meta.lease_id,
        )

    def get(self, key: str) -> KV | None:
        value, meta = self.call(lambda c: c.get(key))
        return None if meta is None else self._kv(value, meta)

    def get_prefix(self, prefix: str, *, keys_only: bool = False,
                   range_end: str | None = None) -> tuple[list[KV], int]:
        """Read every key under ``prefix`` in one range request (values empty if ``keys_only``;
        with ``range_end``, the keys in [prefix, range_end) instead).

        Returns:
            The key-values sorted by key, and the store revision the read was served at
            (start a watch from ``revision + 1`` to see every later change).
        """

        def read(c: etcd3.MultiEndpointEtcd3Client) -> tuple[list[KV], int]:
            end = _range_end(prefix, range_end)
            resp = c.get_range_response(prefix, end, sort_order="ascend", sort_target="key",
                                        keys_only=keys_only)
            kvs = [
                KV(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision, kv.lease)
                for kv in resp.kvs
            ]
            return kvs, resp.header.revision

        return self.call(read)

    def count_prefix(self, prefix: str) -> int:
        def count(c: etcd3.MultiEndpointEtcd3Client) -> int:
            range_end = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))
            return int(c.get_range_response(prefix, range_end, count_only=True).count)

        return self.call(count)

    def put(self, key: str, value: bytes | str, lease: int | None = None) -> None:
        self.call(lambda c: c.put(key, value, lease=lease))

    def delete(self, key: str) -> bool:
        return bool(self.call(lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> None:
        self.call(lambda c: c.delete_prefix(prefix))

    def delete_prefixes_if(self, key: str, *, mod_revision: int, prefixes: Sequence[str]) -> bool:
        """Delete everything under ``prefixes`` in one transaction, only if ``key``'s
        mod_revision is still ``mod_revision``. Returns True if the delete happened."""
        return self.txn([ModRevision(key, mod_revision)], [DeletePrefix(p) for p in prefixes])

    def txn(self, compares: Sequence[Compare], success: Sequence[Op],
            failure: Sequence[Op] = ()) -> bool:
        """Run one transaction: ``success`` if every compare holds, else ``failure``.

        Args:
            compares: typed compares (``elasticd.etcd.txn``), all of which must hold.
            success, failure: typed operations run in either case.

        Returns:
            True if the compares held (``success`` ran), False if not (a refusal, not an
            error: only a failed compare returns False).

        Raises:
            EtcdUnavailableError: etcd did not answer (the outcome is unknown).
        """

        return self.txn_read(compares, success, failure)[0]

    def txn_read(self, compares: Sequence[Compare], success: Sequence[Op],
                 failure: Sequence[Op] = ()) -> tuple[bool, list[KV | None]]:
        """:meth:`txn`, also returning what its ``Get`` operations read: one request.

        Returns:
            Whether the compares held, and one entry per ``Get`` of the branch that ran,
            in order: the key as the transaction left it (writes before the ``Get`` in
            the same branch included), or None where the key does not exist.

        Raises:
            EtcdUnavailableError: etcd did not answer (the outcome is unknown).
        """

        def run(c: etcd3.MultiEndpointEtcd3Client) -> tuple[bool, list[KV | None]]:
            t = c.transactions
            ok, responses = c.transaction(compare=[raw_compare(t, x) for x in compares],
                                          success=[raw_op(t, op) for op in success],
                                          failure=[raw_op(t, op) for op in failure])
            # python3-etcd3 gives a range response as a list of (value, metadata) and the
            # others as protobuf messages.
            reads = [self._kv(*r[0]) if r else None for r in responses if isinstance(r, list)]
            return bool(ok), reads

        ok, reads = self.call(run)
        return bool(ok), reads

    def put_if(self, key: str, value: bytes | str, *, mod_revision: int,
               lease: int | None = None, extra_compare: Sequence[Compare] = (),
               extra_ops: Sequence[Op] = ()) -> bool:
        """Compare-and-swap: write ``key`` only if its mod_revision is ``mod_revision``.

        ``mod_revision=0`` means "only if the key does not exist".
        Returns True if the write happened.
        """
        return self.txn([ModRevision(key, mod_revision), *extra_compare],
                        [Put(key, value, lease=lease), *extra_ops])

    # -- leases -----------------------------------------------------------------------
    def grant_lease(self, ttl_s: int) -> int:
        return int(self.call(lambda c: c.lease(int(ttl_s)).id))

    def refresh_lease(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Send one keep-alive. Returns the remaining TTL; <= 0 means the lease is gone.

        Args:
            timeout_s: deadline of this keep-alive (default: the client's ``timeout_s``).
        """

        def refresh(c: etcd3.MultiEndpointEtcd3Client) -> int:
            if timeout_s is None:
                responses = list(c.refresh_lease(lease_id))
            else:
                responses = list(c.leasestub.LeaseKeepAlive(
                    iter([etcd3.etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout_s,
                    credentials=c.call_credentials, metadata=c.metadata))
            return int(responses[0].TTL) if responses else 0

        return self.call(refresh)

    def revoke_lease(self, lease_id: int) -> None:
        def revoke(c: etcd3.MultiEndpointEtcd3Client) -> None:
            try:
                c.revoke_lease(lease_id)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # already expired: fine
                    raise

        self.call(revoke)

    # -- watches ----------------------------------------------------------------------
    def add_watch(self, prefix: str, callback: Callable[[Any], None], start_revision: int, *,
                  range_end: str | None = None) -> WatchHandle:
        """Create a watch; the handle names the stream it lives on (cancel it with
        ``cancel_watch``, on that stream: see ``WatchHandle``)."""

        def add(c: etcd3.MultiEndpointEtcd3Client) -> WatchHandle:
            for _ in range(_WATCH_CREATE_TRIES):
                watcher = c.watcher  # the stream this watch is created on, held with its id
                try:
                    wid = watcher.add_callback(prefix, callback,
                                               range_end=_range_end(prefix, range_end),
                                               start_revision=start_revision)
                except StreamClosedError:
                    continue  # the client replaced that stream meanwhile: on the current one
                except grpc.RpcError as exc:
                    c._manage_grpc_errors(exc)  # as add_watch_callback: fail the endpoint, re-raise
                    raise
                except queue.Empty as exc:
                    raise etcd3.exceptions.WatchTimedOut() from exc
                return WatchHandle(watcher, int(wid))
            raise etcd3.exceptions.WatchTimedOut()  # streams replaced faster than one answers

        return self.call(add)

    def cancel_watch(self, handle: WatchHandle) -> None:
        """Cancel a watch on the stream it was created on (no etcd round trip to wait for)."""
        try:
            cancel_on(handle)
        except Exception:  # the stream is already gone; nothing left to cancel
            pass

    def watch_prefix(self, prefix: str, on_events: Callable[[list[WatchEvent]], None],
                     on_resync: Callable[[list[KV], int], None], *, name: str = "",
                     range_end: str | None = None,
                     health_interval_s: float = WATCH_HEALTH_INTERVAL_S) -> PrefixWatch:
        """Keep a prefix (or the key range [prefix, range_end)) in sync:
        ``on_resync(snapshot, revision)`` then ``on_events(...)``; the watch is checked
        against a read of its range every ``health_interval_s`` and re-created if silent.

        See ``PrefixWatch``.
        """
        watch = PrefixWatch(self, prefix, on_events, on_resync, name=name, range_end=range_end,
                            health_interval_s=health_interval_s)
        with self._lock:
            self._watches.add(watch)
        watch.start()
        return watch

    def endpoint_label(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)


# The TLS settings as a user types them: the flags of every command, then the config keys.
_TLS_FLAGS = "--etcd-ca, --etcd-cert and --etcd-key (etcd.ca_file, cert_file, key_file)"


def _range_end(prefix: str, range_end: str | None) -> bytes:
    """etcd's range end: the end of ``prefix``'s key range, or ``range_end`` as given."""
    if range_end is not None:
        return etcd3.utils.to_bytes(range_end)
    return etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))


__all__ = [
    "KV", "NOSPACE_FIX", "EtcdClient", "LeaseKeeper", "PrefixWatch", "TLSFiles", "WatchEvent",
    "WatchHandle",
    "endpoints_scheme", "kv_map", "parse_endpoints",
]
