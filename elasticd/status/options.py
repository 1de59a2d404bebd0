"""Options of `elasticd status`: validated once, then passed around as a frozen value.

Also the exact wording of the exit-3 and exit-4 lines, shared by the one-shot and the
--watch paths.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from elasticd.errors import ETCD_UNREACHABLE_HINT, ConfigError
from elasticd.etcd.client import EtcdClient, TLSFiles, parse_endpoints
from elasticd.keys import JobKeys, validate_job_name
from elasticd.sensitive import read_secret_file
from elasticd.status.model import DEFAULT_WINDOW_S

DEFAULT_ETCD = "127.0.0.1:2379"
DEFAULT_TIMEOUT_S = 3.0
DEFAULT_EVENTS = 10
PROG = "elasticd status"


@dataclass(frozen=True)
class StatusOptions:
    """Validated options of one `elasticd status` invocation."""

    endpoints: str = DEFAULT_ETCD
    job: str | None = None
    json: bool = False
    watch: bool = False
    events: int = DEFAULT_EVENTS
    window_s: float = DEFAULT_WINDOW_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_rows: int | None = None  # None: DEFAULT_MAX_ROWS, or what fits the terminal in --watch
    tls: TLSFiles = field(default_factory=TLSFiles)
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # never printed or logged
    insecure_plaintext_auth: bool = False  # send the password without TLS (opt-in)

    @property
    def endpoint_list(self) -> list[str]:
        return [f"{h}:{p}" for h, p in parse_endpoints(self.endpoints)]


def options_from_args(args: argparse.Namespace) -> StatusOptions:
    """Validate parsed flags into ``StatusOptions``.

    Raises:
        ConfigError: invalid job name or endpoints, unreadable password file, a user
            without a password file (or the reverse).
    """
    job = getattr(args, "job", None)
    if job is not None:
        validate_job_name(job)
    endpoints = getattr(args, "etcd", None) or DEFAULT_ETCD
    parse_endpoints(endpoints)
    user = getattr(args, "etcd_user", None)
    pw_file = getattr(args, "etcd_password_file", None)
    if bool(user) != bool(pw_file):
        raise ConfigError("etcd auth needs both --etcd-user and --etcd-password-file")
    return StatusOptions(
        endpoints=endpoints, job=job, json=bool(getattr(args, "json", False)),
        watch=bool(getattr(args, "watch", False)),
        events=getattr(args, "events", DEFAULT_EVENTS),
        window_s=getattr(args, "window", DEFAULT_WINDOW_S),
        timeout_s=getattr(args, "timeout", DEFAULT_TIMEOUT_S),
        max_rows=getattr(args, "max_rows", None),
        tls=TLSFiles(getattr(args, "etcd_ca", None), getattr(args, "etcd_cert", None),
                     getattr(args, "etcd_key", None)),
        user=user or None,
        password=read_secret_file(pw_file, "--etcd-password-file") if pw_file else None,
        insecure_plaintext_auth=bool(getattr(args, "etcd_insecure_plaintext_auth", False)),
    )


def make_client(opts: StatusOptions) -> EtcdClient:
    """An etcd client whose every call gives up after ``opts.timeout_s``."""
    return EtcdClient(opts.endpoints, timeout_s=opts.timeout_s, tls=opts.tls,
                      user=opts.user, password=opts.password,
                      allow_plaintext_auth=opts.insecure_plaintext_auth)


def unreachable_message(opts: StatusOptions, exc: Exception) -> str:
    """The exit-4 line: which endpoints, which bound, what went wrong, what to check."""
    why = " ".join(str(exc).split())
    prefix = f"etcd at {','.join(opts.endpoint_list)} unreachable: "
    why = why[len(prefix):] if why.startswith(prefix) else why
    return (f"etcd unreachable at {opts.endpoints} within {opts.timeout_s:g}s ({why}); "
            f"{ETCD_UNREACHABLE_HINT}")


def unknown_job_message(opts: StatusOptions) -> str:
    """The exit-3 line."""
    assert opts.job is not None
    return (f"job {opts.job!r} unknown: no keys under {JobKeys(opts.job).prefix} at "
            f"{opts.endpoints}; check --job and --etcd (`{PROG}` without --job lists jobs)")


def add_etcd_connection_flags(p: argparse.ArgumentParser, *,
                              timeout_type: Callable[[str], float]) -> None:
    """The etcd connection flags every etcd client command takes (``status``, ``stop``,
    ``drain``, ``start``): one definition, read back by :func:`options_from_args`.

    Args:
        p: the subcommand's parser.
        timeout_type: how ``--timeout`` is parsed (the caller decides how a bad value exits).
    """
    p.add_argument("--etcd", metavar="ENDPOINTS", default=None,
                   help=f"etcd endpoints, HOST:PORT[,HOST:PORT...] (default {DEFAULT_ETCD})")
    p.add_argument("--etcd-ca", metavar="FILE", help="CA bundle to verify etcd's certificate")
    p.add_argument("--etcd-cert", metavar="FILE", help="client certificate for etcd (with --etcd-key)")
    p.add_argument("--etcd-key", metavar="FILE", help="client key for etcd (with --etcd-cert)")
    p.add_argument("--etcd-user", metavar="USER", help="etcd user (with --etcd-password-file)")
    p.add_argument("--etcd-password-file", metavar="FILE",
                   help="file holding the etcd password (never passed on the command line)")
    p.add_argument("--etcd-insecure-plaintext-auth", action="store_true",
                   help="INSECURE: send the etcd password without TLS (trusted networks only)")
    p.add_argument("--timeout", type=timeout_type, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"give up on etcd after this long, exit 4 (default {DEFAULT_TIMEOUT_S:g})")
