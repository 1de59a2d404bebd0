"""Where etcd is and how to reach it: endpoint parsing and the client's TLS files.

Kept apart from the client because ``elasticd status``, the config loader and the
embedded server validate endpoints and TLS settings without ever opening a connection.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from elasticd.errors import ConfigError

MAX_TLS_FILE_BYTES = 1024 * 1024


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


def read_tls_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            # A bound: certificates are kilobytes; a wrong path (/dev/zero) must not hang.
            data = fh.read(MAX_TLS_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read etcd {what} {path!r}: {exc.strerror}; check the path") from exc
    if len(data) > MAX_TLS_FILE_BYTES:
        raise ConfigError(f"etcd {what} {path!r} is larger than {MAX_TLS_FILE_BYTES} bytes, so not "
                          "a PEM file; check the path")
    if b"-----BEGIN " not in data:
        # gRPC would log C++ errors and fail the connection (exit 4, not a config error).
        raise ConfigError(f"etcd {what} {path!r} is not a PEM file (no '-----BEGIN' line); "
                          "pass the PEM-encoded file (e.g. ca.pem), not a DER or other file")
    return data


