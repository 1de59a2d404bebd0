"""A hardened etcd v3 client: the only module that talks to python3-etcd3.

python3-etcd3 0.13.0 is a thin gRPC wrapper with sharp edges for a daemon that must
run for weeks through etcd restarts. This module keeps every work-around in one place:

- A connection error marks an endpoint "failed" for 300 s by default, so every call
  raises ``ValueError: Trying to use a failed node`` long after etcd is back. We build
  endpoints with ``time_retry=0`` and fail over between them.
- ``etcd3/watch.py`` uses ``six`` without importing it, so a dropped watch stream kills
  the watch thread silently. We patch the name in, and ``PrefixWatch`` re-creates its
  watch from the last seen revision + 1 whenever the stream dies.
- Calls without a timeout can block forever: every call carries ``timeout_s``.
- Leases are not kept alive by the library: ``LeaseKeeper`` does it.
- Auth tokens expire: on an auth error the underlying client is rebuilt (re-auth).

Every error leaving this module is either ``EtcdUnavailableError`` (transient: retry;
its subclass ``EtcdNoSpaceError`` when etcd raised its NOSPACE alarm and refuses writes
until an operator compacts, defragments and disarms), ``ConfigError`` (bad endpoints, TLS
files or credentials, a wrong password: fix the config) or a plain result (a failed
transaction returns ``False``).

Trust rules (docs/security.md): credentials are never sent in plaintext unless the
caller says ``allow_plaintext_auth=True`` (the loudly named config flag); an ``https://``
endpoint always means TLS, verified against gRPC's default roots when no CA is given.
"""

from __future__ import annotations

import re
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import etcd3
import etcd3.exceptions
import etcd3.watch
import grpc
import structlog
from etcd3 import events as etcd_events

from elasticd.errors import ConfigError, EtcdNoSpaceError, EtcdUnavailableError, LeaseLostError

log = structlog.get_logger(__name__)

# Work-around: etcd3/watch.py calls six.itervalues without importing six.
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(list(d.values())))  # type: ignore[attr-defined]

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
MAX_TLS_FILE_BYTES = 1024 * 1024
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
NOSPACE_FIX = ("etcd raised its NOSPACE alarm (database space exceeded) and refuses writes: "
               "compact and defragment etcd, then `etcdctl alarm disarm` "
               "(docs/deployment.md#etcd-space-compaction-and-nospace)")


@dataclass(frozen=True)
class KV:
    """One key-value pair as read from etcd."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """A change to one key. ``value`` is None for deletions (including lease expiry)."""

    key: str
    value: bytes | None
    mod_revision: int


@dataclass(frozen=True)
class TLSFiles:
    """Client TLS material: a CA bundle and optionally a client certificate and key."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file or self.key_file)


def endpoints_scheme(endpoints: str | Sequence[str]) -> str | None:
    """``"https"`` if the endpoints are written ``https://...``, ``"http"`` for
    ``http://...``, None when no scheme is written.

    Raises:
        ConfigError: schemes are mixed (one cluster is served one way).
    """
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    written = [item.strip() for item in items if item.strip()]
    schemes = {i.partition("://")[0].lower() if "://" in i else "http" for i in written}
    if len(schemes) > 1:
        raise ConfigError(f"etcd endpoints mix schemes ({', '.join(sorted(schemes))}): write all "
                          "of them https:// (TLS) or all http://")
    if not any("://" in i for i in written):
        return None
    return schemes.pop() if schemes else None


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """Parse ``"h1:2379,h2:2379"`` (or a list) into (host, port) pairs.

    Raises:
        ConfigError: an endpoint is empty or has no valid port (ASCII digits only).
    """
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out: list[tuple[str, int]] = []
    for raw in items:
        item = raw.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        if "@" in item:
            raise ConfigError(
                f"etcd endpoint '***@{item.rsplit('@', 1)[1]}' carries credentials: they do not go "
                "in the URL (it is logged and shown); use etcd.user with etcd.password_file "
                "(--etcd-user, --etcd-password-file)"
            )
        host, sep, port = item.rpartition(":")
        if (not item or not sep or not host or not re.fullmatch(r"[0-9]{1,5}", port)
                or not 0 < int(port) < 65536):
            raise ConfigError(
                f"invalid etcd endpoint {raw!r}: expected HOST:PORT, e.g. 127.0.0.1:2379 "
                "(several endpoints separated by commas)"
            )
        out.append((host, int(port)))
    if not out:
        raise ConfigError("no etcd endpoint given: pass --etcd HOST:PORT or use --standalone")
    return out


def _read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            # A bound: certificates are kilobytes; a wrong path (/dev/zero) must not hang.
            data = fh.read(MAX_TLS_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read etcd {what} {path!r}: {exc.strerror}; check the path") from exc
    if len(data) > MAX_TLS_FILE_BYTES:
        raise ConfigError(f"etcd {what} {path!r} is larger than {MAX_TLS_FILE_BYTES} bytes, so not "
                          "a PEM file; check the path")
    return data


def _grpc_detail(exc: BaseException) -> str:
    """gRPC's own reason for a failure (python3-etcd3 re-raises it as a bare exception)."""
    for candidate in (exc, exc.__context__):
        if isinstance(candidate, grpc.RpcError) and hasattr(candidate, "details"):
            return str(candidate.details() or "")
    return str(exc)


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
        self._creds = self._credentials()
        # Reentrant: raw() translates a failed authentication while holding it, and the
        # translation drops the client under the same lock (a plain Lock deadlocked there).
        self._lock = threading.RLock()
        self._raw: etcd3.MultiEndpointEtcd3Client | None = None
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

    # -- plumbing ---------------------------------------------------------------------
    def _credentials(self) -> grpc.ChannelCredentials | None:
        if not self.secure:
            return None
        if bool(self.tls.cert_file) != bool(self.tls.key_file):
            raise ConfigError("etcd TLS: cert_file and key_file must be given together")
        ca = _read_file(self.tls.ca_file, "CA file") if self.tls.ca_file else None
        cert = _read_file(self.tls.cert_file, "client certificate") if self.tls.cert_file else None
        key = _read_file(self.tls.key_file, "client key") if self.tls.key_file else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def _build(self) -> etcd3.MultiEndpointEtcd3Client:
        # gRPC refuses replies over 4 MB by default; a 5,000-node job's status read is bigger.
        opts: Any = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        eps = [
            etcd3.Endpoint(host, port, secure=self._creds is not None, creds=self._creds,
                           time_retry=0, opts=opts)
            for host, port in self.endpoints
        ]
        return etcd3.MultiEndpointEtcd3Client(
            eps, timeout=self.timeout_s, user=self._user, password=self._password, failover=True
        )

    def raw(self) -> etcd3.MultiEndpointEtcd3Client:
        """The underlying python3-etcd3 client, built on first use (authenticates)."""
        with self._lock:
            if self._closed:
                raise EtcdUnavailableError("etcd client is closed")
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
                    f"etcd at {where}: TLS {reason}; check "
                    "ca_file (the CA that signed etcd's server certificate) and cert_file/key_file "
                    "(a client certificate signed by a CA that etcd trusts)"
                )
            hint = ""
            if "socket closed" in detail.lower():
                hint = (" (if etcd serves TLS, set ca_file, cert_file and key_file)" if not self.secure
                        else " (if etcd does not serve TLS, drop ca_file, cert_file and key_file)")
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

    def close(self) -> None:
        with self._lock:
            self._closed = True
            raw, self._raw = self._raw, None
        if raw is not None:
            try:
                raw.close()
            except Exception:  # closing a dead channel may raise; nothing to do
                pass

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

    def get_prefix(self, prefix: str, *, keys_only: bool = False) -> tuple[list[KV], int]:
        """Read every key under ``prefix`` in one range request (values empty if ``keys_only``).

        Returns:
            The key-values sorted by key, and the store revision the read was served at
            (start a watch from ``revision + 1`` to see every later change).
        """

        def read(c: etcd3.MultiEndpointEtcd3Client) -> tuple[list[KV], int]:
            range_end = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))
            resp = c.get_range_response(prefix, range_end, sort_order="ascend", sort_target="key",
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
        ranges = [(p, etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(p))) for p in prefixes]
        ok, _ = self.txn(lambda t: [t.mod(key) == mod_revision],
                         lambda t: [t.delete(p, range_end=end) for p, end in ranges])
        return ok

    def txn(self, compare: Callable[[Any], list[Any]], success: Callable[[Any], list[Any]],
            failure: Callable[[Any], list[Any]] | None = None) -> tuple[bool, list[Any]]:
        """Run a transaction built from ``c.transactions`` helpers.

        ``compare``/``success``/``failure`` receive the ``Transactions`` factory, so callers
        write ``lambda t: [t.mod(key) == rev]`` without touching the raw client.
        """

        def run(c: etcd3.MultiEndpointEtcd3Client) -> tuple[bool, list[Any]]:
            t = c.transactions
            return c.transaction(
                compare=compare(t), success=success(t), failure=failure(t) if failure else []
            )

        return self.call(run)

    def put_if(self, key: str, value: bytes | str, *, mod_revision: int,
               lease: int | None = None, extra_compare: Callable[[Any], list[Any]] | None = None,
               extra_ops: Callable[[Any], list[Any]] | None = None) -> bool:
        """Compare-and-swap: write ``key`` only if its mod_revision is ``mod_revision``.

        ``mod_revision=0`` means "only if the key does not exist".
        Returns True if the write happened.
        """
        ok, _ = self.txn(
            lambda t: [t.mod(key) == mod_revision] + (extra_compare(t) if extra_compare else []),
            lambda t: [t.put(key, value, lease=lease)] + (extra_ops(t) if extra_ops else []),
        )
        return ok

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
    def add_watch(self, prefix: str, callback: Callable[[Any], None], start_revision: int) -> int:
        def add(c: etcd3.MultiEndpointEtcd3Client) -> int:
            range_end = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))
            return int(c.add_watch_callback(prefix, callback, range_end=range_end,
                                            start_revision=start_revision))

        return self.call(add)

    def cancel_watch(self, watch_id: int) -> None:
        try:
            self.call(lambda c: c.cancel_watch(watch_id))
        except Exception:  # the stream is already gone; nothing left to cancel
            pass

    def watch_prefix(self, prefix: str, on_events: Callable[[list[WatchEvent]], None],
                     on_resync: Callable[[list[KV], int], None], *, name: str = "") -> PrefixWatch:
        """Keep a prefix in sync: ``on_resync(snapshot, revision)`` then ``on_events(...)``.

        See ``PrefixWatch``.
        """
        watch = PrefixWatch(self, prefix, on_events, on_resync, name=name)
        with self._lock:
            self._watches.add(watch)
        watch.start()
        return watch

    def endpoint_label(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)


class PrefixWatch:
    """A watch on a prefix that survives etcd restarts and dropped streams.

    Contract: ``on_resync(kvs, revision)`` is called first with a full snapshot, and again
    after every reconnect (the consumer replaces its view); ``on_events(events)`` is called
    for each change after the snapshot, in revision order, from one thread. A reconnect
    resumes from the last seen revision + 1, so no change is missed; if that revision was
    compacted, a fresh snapshot is taken instead.
    """

    def __init__(self, client: EtcdClient, prefix: str,
                 on_events: Callable[[list[WatchEvent]], None],
                 on_resync: Callable[[list[KV], int], None], *, name: str = "") -> None:
        self._client = client
        self._prefix = prefix
        self._on_events = on_events
        self._on_resync = on_resync
        self._name = name or prefix
        self._stop = threading.Event()
        self._broken = threading.Event()
        self._lock = threading.Lock()
        self._watch_id: int | None = None
        self._revision = 0  # last revision delivered to the consumer
        self._need_snapshot = True
        self._thread = threading.Thread(target=self._run, name=f"watch:{self._name}", daemon=True)
        self.connected = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop the watch. ``wait=False`` returns at once: the watch thread cancels its own
        watch on the way out (with etcd down, a cancel or a reconnect attempt can block for
        the call timeout, which a caller with a deadline cannot spend)."""
        self._stop.set()
        self._broken.set()
        if not wait:
            return
        with self._lock:
            wid, self._watch_id = self._watch_id, None
        if wid is not None:
            self._client.cancel_watch(wid)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    @property
    def revision(self) -> int:
        return self._revision

    def reconnect(self) -> None:
        """Drop the current stream and resume from the last revision + 1 (the client moved
        to another endpoint)."""
        self.connected.clear()
        self._broken.set()

    def _callback(self, response: Any) -> None:
        if self._stop.is_set():
            return
        if isinstance(response, Exception) or not hasattr(response, "events"):
            if isinstance(response, etcd3.exceptions.RevisionCompactedError):
                self._need_snapshot = True
            self.connected.clear()
            self._broken.set()
            return
        out: list[WatchEvent] = []
        for ev in response.events:
            if ev.mod_revision <= self._revision:
                continue  # replay after reconnect
            value = None if isinstance(ev, etcd_events.DeleteEvent) else ev.value
            out.append(WatchEvent(ev.key.decode(), value, ev.mod_revision))
        if out:
            self._revision = max(e.mod_revision for e in out)
            try:
                self._on_events(out)
            except Exception:
                log.exception("watch_consumer_failed", watch=self._name)

    def _connect(self) -> None:
        # Cleared before the new watch exists, never after: a stop() or a stream break that
        # lands while we connect must still wake the park in _run (else it parks forever
        # and the watch leaks).
        self._broken.clear()
        if self._need_snapshot:
            kvs, rev = self._client.get_prefix(self._prefix)
            self._revision = rev
            self._on_resync(kvs, rev)
            self._need_snapshot = False
        wid = self._client.add_watch(self._prefix, self._callback, self._revision + 1)
        with self._lock:
            self._watch_id = wid
        self.connected.set()

    def _run(self) -> None:
        backoff = 0.05
        failing = False
        while not self._stop.is_set():
            try:
                self._connect()
                if failing:
                    log.info("etcd_watch_resumed", watch=self._name, revision=self._revision)
                failing, backoff = False, 0.05
                # Park until the stream breaks (callback sets _broken) or we are stopped
                # (stop() sets _stop before _broken, so one of the two is seen here).
                if not self._stop.is_set():
                    self._broken.wait()
            except Exception as exc:
                if self._stop.is_set():
                    break
                if not failing:
                    log.warning("etcd_watch_interrupted", watch=self._name, error=str(exc))
                failing = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 1.0)
            with self._lock:
                wid, self._watch_id = self._watch_id, None
            if wid is not None:  # whoever takes the id cancels it (stop() may have missed it)
                self._client.cancel_watch(wid)


class LeaseKeeper:
    """Keeps one lease alive from a background thread.

    Keep-alives go out every ``ttl_s / 3``. Transient etcd errors are tolerated (the lease
    lives on the server until its TTL runs out, and etcd renews every lease's TTL when
    it restarts). If etcd answers that the lease is gone, ``lost`` is set and
    ``on_lost`` is called once: this node was frozen or cut off for longer than its TTL.
    """

    def __init__(self, client: EtcdClient, lease_id: int, ttl_s: int,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.client = client
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.lost = threading.Event()
        self.last_ok = time.monotonic()
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease:{lease_id:x}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self, revoke: bool = False) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        if revoke and not self.lost.is_set():
            try:
                self.client.revoke_lease(self.lease_id)
            except Exception as exc:  # best effort: the TTL will expire it anyway
                log.warning("lease_revoke_failed", lease=hex(self.lease_id), error=str(exc))

    def _run(self) -> None:
        interval = max(self.ttl_s / 3.0, 0.2)
        # A keep-alive sent to a frozen or dead member must not eat the TTL: bounded by a
        # third of it, the retry on the next member still lands before the lease expires.
        call_timeout_s = min(self.client.timeout_s, interval)
        failing = False
        while not self._stop.wait(interval if not failing else min(interval, 0.25)):
            try:
                ttl = self.client.refresh_lease(self.lease_id, timeout_s=call_timeout_s)
            except Exception as exc:
                if not failing:
                    log.warning("lease_keepalive_failed", lease=hex(self.lease_id), error=str(exc))
                failing = True
                continue
            if failing:
                log.info("lease_keepalive_resumed", lease=hex(self.lease_id), ttl_s=ttl)
                failing = False
            if ttl <= 0:
                self.lost.set()
                log.warning("lease_lost", lease=hex(self.lease_id))
                if self._on_lost:
                    self._on_lost()
                return
            self.last_ok = time.monotonic()


def kv_map(kvs: Iterable[KV]) -> dict[str, KV]:
    """Index key-values by key."""
    return {kv.key: kv for kv in kvs}
