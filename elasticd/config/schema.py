"""The table of configuration keys: name, type (a parser), default, example.

One row per key keeps the loader, the environment mapping, ``--check-config`` output
and docs/configuration.md (checked by a test) from drifting apart.

A parser takes ``(value, text)``: ``text`` is True when the value is a string from the
environment or a flag and may be converted (``"5"`` -> 5); TOML values are already
typed and must have the right type (``ttl_s = "5"`` is an error, so a quoted number
in the file is caught instead of silently accepted). Parsers raise :class:`Invalid`
with the problem and, optionally, the fix; the loader adds the key, value and origin.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import os
import re
import shlex
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

SECTIONS = (
    "job", "checkpoint", "etcd", "node", "rendezvous", "workers", "restart", "drain", "preemption", "logging",
    "metrics",
)
RESUME_MODES = ("auto", "require", "never")
PROVIDERS = ("none", "aws", "gcp", "azure", "auto")
LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_ETCD_PORT = 2379
REQUIRED: Any = object()  # sentinel default of a key that must be set
UNQUOTE = "unquote"  # Invalid.fix marker: a number was written as a TOML string

Parser = Callable[[Any, bool], Any]


class Invalid(Exception):
    """A value is wrong. ``problem`` says what; ``fix`` (optional) says what to write."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix


@dataclass(frozen=True)
class Key:
    """One configuration key."""

    section: str
    name: str
    parse: Parser
    default: Any
    example: str  # a valid TOML line, used in "write ..." fixes

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env_var(self) -> str:
        return f"ELASTICD_{self.section.upper()}_{self.name.upper()}"


def _kind(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "a list", dict: "a table"}
    return names.get(type(value), type(value).__name__)


def integer(lo: int, hi: int | None = None) -> Parser:
    """A whole number in ``[lo, hi]``."""

    def parse(value: Any, text: bool) -> int:
        if text and isinstance(value, str):
            # ASCII digits only: int() also takes e.g. Arabic-Indic digits.
            if not re.fullmatch(r"[+-]?[0-9]+", value.strip()):
                raise Invalid("not a whole number")
            value = int(value.strip(), 10)
        elif isinstance(value, bool) or not isinstance(value, int):
            fix = UNQUOTE if isinstance(value, str) else ""
            raise Invalid(f"expected a whole number, got {_kind(value)}", fix)
        if value < lo or (hi is not None and value > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise Invalid(f"must be {bound}")
        return value

    return parse


def lease_ttl(value: Any, text: bool) -> int:
    """A node lease TTL in whole seconds: etcd's minimum is 2 s, an hour is the most."""
    ttl = integer(-(2**63))(value, text)
    if not 2 <= ttl <= 3600:
        raise Invalid("must be between 2 and 3600 (etcd's minimum lease TTL is 2 s)")
    return ttl


def number(lo: float, *, lo_open: bool = False, hi: float | None = None) -> Parser:
    """A finite number of seconds (int or float) ``>= lo`` (``> lo`` if ``lo_open``)."""

    def parse(value: Any, text: bool) -> float:
        if text and isinstance(value, str):
            try:
                if not value.strip().isascii():
                    raise ValueError(value)
                value = float(value.strip())
            except ValueError:
                raise Invalid("not a number") from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            fix = UNQUOTE if isinstance(value, str) else ""
            raise Invalid(f"expected a number, got {_kind(value)}", fix)
        if not math.isfinite(value):
            raise Invalid("must be a finite number")
        if value < lo or (lo_open and value == lo):
            raise Invalid(f"must be {'greater than' if lo_open else 'at least'} {lo:g}")
        if hi is not None and value > hi:
            raise Invalid(f"must be at most {hi:g}")
        return float(value)

    return parse


def boolean(value: Any, text: bool) -> bool:
    """``true``/``false`` (TOML); from text also yes/no, on/off, 1/0."""
    if text and isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "yes", "on", "1"):
            return True
        if word in ("false", "no", "off", "0"):
            return False
        raise Invalid("not a boolean", "write true or false")
    if not isinstance(value, bool):
        raise Invalid(f"expected true or false, got {_kind(value)}")
    return value


def string(value: Any, text: bool) -> str:
    """A non-empty string."""
    if not isinstance(value, str):
        raise Invalid(f"expected a string, got {_kind(value)}")
    if not value.strip():
        raise Invalid("must not be empty")
    return value


def optional_string(value: Any, text: bool) -> str | None:
    """A string; empty means unset (None)."""
    if not isinstance(value, str):
        raise Invalid(f"expected a string, got {_kind(value)}")
    return value or None


def checkpoint_url(value: Any, text: bool) -> str | None:
    """A checkpoint URL (any fsspec URL); credentials inside it are refused, as for etcd
    endpoints: they would be printed in logs, status and process listings."""
    url = optional_string(value, text)
    if url is not None and "://" in url and "@" in urlsplit(url).netloc:
        raise Invalid("has credentials in the URL (user:secret@); pass them through the "
                      "storage's own configuration instead (AWS_* variables, ~/.aws, an "
                      "instance role, or storage_options)")
    return url


def checkpoint_every(value: Any, text: bool) -> int | str | None:
    """``"auto"`` (the Young–Daly cadence, ``checkpoint.cadence``), a whole number of steps
    >= 1, or empty/unset (the script's own ``save_every``)."""
    fix = 'write every = "auto" or a number of steps, e.g. every = 200'
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        raise Invalid('must be "auto" or a whole number of steps', fix)
    if isinstance(value, str) and text:
        try:
            value = int(value.strip())
        except ValueError:
            raise Invalid('must be "auto" or a whole number of steps', fix) from None
    if not isinstance(value, int):
        raise Invalid('must be "auto" or a whole number of steps', fix)
    if value < 1:
        raise Invalid("must be at least 1 step", fix)
    return value


def choice(*options: str) -> Parser:
    """One of ``options`` (case-insensitive)."""

    def parse(value: Any, text: bool) -> str:
        if not isinstance(value, str) or value.strip().lower() not in options:
            raise Invalid(f"must be one of {', '.join(repr(o) for o in options)}")
        return value.strip().lower()

    return parse


def nnodes(value: Any, text: bool) -> tuple[int, int]:
    """``"min:max"`` or a single count -> ``(min, max)``, with ``1 <= min <= max``."""
    fix = 'write nnodes = "<min>:<max>" with 1 <= min <= max, e.g. nnodes = "2:8", or nnodes = 4'
    if isinstance(value, bool):
        raise Invalid("expected a node count or \"min:max\", got a boolean", fix)
    if isinstance(value, int):
        lo = hi = value
    elif isinstance(value, str):
        head, sep, tail = value.strip().partition(":")
        try:
            if not value.isascii():  # int() reads other scripts' digits ("١:٢" was 1:2)
                raise ValueError(value)
            lo = int(head, 10)
            hi = int(tail, 10) if sep else lo
        except ValueError:
            raise Invalid("not a node count or \"min:max\" range", fix) from None
    else:
        raise Invalid(f"expected a node count or \"min:max\", got {_kind(value)}", fix)
    if lo < 1:
        raise Invalid(f"the minimum node count {lo} is below 1", fix)
    if lo > hi:
        raise Invalid(f"the minimum {lo} is larger than the maximum {hi}", fix)
    return lo, hi


def node_counts(value: Any, text: bool) -> tuple[int, ...]:
    """Valid world sizes in nodes: a list of node counts >= 1, or ``"2,4,8"`` (a flag).

    Range (within ``job.nnodes``) is checked with the other keys (``rendezvous.sizes``).
    """
    fix = "write valid_sizes = [2, 4, 8] (node counts within job.nnodes), or leave it out"
    if isinstance(value, str):
        items: list[Any] = [s.strip() for s in value.split(",")]
        if not re.fullmatch(r"[0-9]+(,[0-9]+)*", ",".join(items)):
            raise Invalid(f"not a comma-separated list of node counts: {value!r}", fix)
        items = [int(s, 10) for s in items]
    elif isinstance(value, (list, tuple)):
        items = list(value)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in items):
            raise Invalid("every item must be a whole number of nodes", fix)
    else:
        raise Invalid(f"expected a list of node counts, got {_kind(value)}", fix)
    if not items:
        raise Invalid("an empty list allows no world size at all", fix)
    if any(n < 1 for n in items):
        raise Invalid("a node count must be at least 1", fix)
    return tuple(sorted(set(items)))


def nproc(value: Any, text: bool) -> int | str:
    """A worker count >= 1, ``"gpu"`` (one per GPU) or ``"auto"`` (GPUs, else 1)."""
    fix = 'write nproc_per_node = 8, or "gpu" (one per visible GPU), or "auto"'
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("gpu", "auto"):
            return word
        if not (text and re.fullmatch(r"[0-9]+", word)):
            raise Invalid("not a worker count, \"gpu\" or \"auto\"", fix)
        value = int(word)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"expected a worker count, got {_kind(value)}", fix)
    if not 1 <= value <= MAX_NPROC_PER_NODE:
        raise Invalid(f"must be between 1 and {MAX_NPROC_PER_NODE} (workers on one node)", fix)
    return value


MAX_NPROC_PER_NODE = 1024  # the control channel's bound on local ranks
MIN_HANG_TIMEOUT_S = 1.0


def straggler_factor(value: Any, text: bool) -> float:
    """0 (off) or a factor above 1: a node this many times slower than the median."""
    factor = number(0, hi=100)(value, text)
    if 0 < factor <= 1:
        raise Invalid(f"{factor:g} would flag healthy nodes",
                      "give a factor above 1 (straggler_factor = 1.25), or 0 to turn "
                      "straggler detection off")
    return factor


def hang_timeout(value: Any, text: bool) -> float:
    """0 (off), or a timeout of at least ``MIN_HANG_TIMEOUT_S`` and at most 30 days:
    ``1e-300`` would restart every healthy worker group at its first monitor tick."""
    seconds = number(0, hi=30 * 86400)(value, text)
    if 0 < seconds < MIN_HANG_TIMEOUT_S:
        raise Invalid(f"must be 0 (off) or at least {MIN_HANG_TIMEOUT_S:g} s; use several times "
                      "your slowest step-free stretch, e.g. 1800")
    return seconds


def command(value: Any, text: bool) -> tuple[str, ...]:
    """The training entry point, as torchrun takes it: a Python script and its
    arguments, or ``-m module`` and its arguments; run with the agent's Python.

    A list of strings, or one string split like a shell (quotes, no expansion).
    """
    fix = 'write command = ["train.py", "--epochs", "10"] or ["-m", "mypkg.train"]'
    if isinstance(value, str):
        try:
            words = shlex.split(value)
        except ValueError as exc:
            raise Invalid(f"cannot be split into words ({exc})", fix) from None
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(w, str) for w in value):
            raise Invalid("every item must be a string", fix)
        words = list(value)
    else:
        raise Invalid(f"expected a list of strings, got {_kind(value)}", fix)
    if not words or not words[0].strip():
        raise Invalid("must name a Python script or -m module to run", fix)
    if words[0] == "-m" and (len(words) < 2 or not words[1].strip()):
        raise Invalid("-m needs a module name", fix)
    return tuple(words)


def endpoints(value: Any, text: bool) -> tuple[str, ...]:
    """etcd endpoints: a list or a comma-separated string of ``[scheme://]host[:port]``.

    Returns ``"host:port"`` strings (port 2379 when left out; IPv6 in brackets), kept as
    ``"https://host:port"`` when written with ``https://``: that means TLS, verified
    against the system roots when ``etcd.ca_file`` is not set. Empty means "start an
    embedded etcd". Mixing http and https is refused.
    """
    fix = 'write endpoints = ["etcd-1:2379", "etcd-2:2379"] (or "h1:2379,h2:2379")'
    if isinstance(value, str):
        items = [s.strip() for s in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        items = [s.strip() for s in value]
    else:
        raise Invalid(f"expected a list of \"host:port\" strings, got {_kind(value)}", fix)
    out = []
    # An endpoint written without a scheme is plaintext, like http://.
    schemes = {i.partition("://")[0] if "://" in i else "http" for i in items if i}
    if len(schemes) > 1:
        raise Invalid(f"endpoints mix schemes ({', '.join(sorted(schemes))})",
                      "write all of them https:// (TLS) or all without a scheme")
    for item in items:
        if not item:
            continue
        scheme, sep, rest = item.partition("://")
        if not sep:
            scheme, rest = "", item
        elif scheme not in ("http", "https"):
            raise Invalid(f"endpoint {item!r} has scheme {scheme!r}; use http or https", fix)
        try:
            parts = urlsplit("//" + rest)
            port = parts.port if parts.port is not None else DEFAULT_ETCD_PORT
        except ValueError:
            raise Invalid(f"endpoint {item!r} has an invalid port", fix) from None
        if port == 0:  # was silently read as 2379 (`parts.port or ...`)
            raise Invalid(f"endpoint {item!r} has port 0, which no etcd listens on; write its "
                          "client port (2379 by default)", fix)
        host = parts.hostname
        if "@" in rest:
            raise Invalid("an endpoint carries credentials in its URL (they would be logged and "
                          "shown)", "set etcd.user and etcd.password_file instead")
        if not host or parts.path or parts.query:
            raise Invalid(f"endpoint {item!r} is not host:port", fix)
        hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        out.append(f"https://{hostport}" if scheme == "https" else hostport)
    return tuple(out)


def http_url(value: Any, text: bool) -> str | None:
    """An ``http(s)://host[:port]`` base URL, or empty for the provider default."""
    value = optional_string(value, text)
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise Invalid("not an http(s) URL", 'write e.g. base_url = "http://169.254.169.254"')
    return value.rstrip("/")


def listen_addr(value: Any, text: bool) -> str:
    """An IP address to listen on (IPv4 or IPv6), e.g. ``127.0.0.1`` or ``0.0.0.0``."""
    value = string(value, text).strip()
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise Invalid("not an IP address",
                      'write addr = "127.0.0.1" (this node only) or the address Prometheus '
                      'scrapes, e.g. "10.0.0.7"') from None
    return value


def host_or_addr(value: Any, text: bool) -> str | None:
    """A host name or IP address without spaces, or empty for "detect"."""
    value = optional_string(value, text)
    if value is not None and (any(c.isspace() for c in value) or "/" in value):
        raise Invalid("not a host name or IP address")
    return value


KEYS: dict[str, Key] = {
    k.dotted: k
    for k in (
        Key("job", "name", string, REQUIRED, 'name = "my-run"'),
        Key("job", "nnodes", nnodes, (1, 1), 'nnodes = "2:8"'),
        Key("job", "checkpoint_url", checkpoint_url, None,
            'checkpoint_url = "s3://bucket/my-run"'),
        Key("job", "standalone", boolean, False, "standalone = true"),
        Key("job", "resume", choice(*RESUME_MODES), "auto", 'resume = "require"'),
        Key("checkpoint", "every", checkpoint_every, None, 'every = "auto"'),
        Key("etcd", "endpoints", endpoints, (), 'endpoints = ["etcd-1:2379", "etcd-2:2379"]'),
        Key("etcd", "ca_file", optional_string, None, 'ca_file = "/etc/elasticd/tls/ca.pem"'),
        Key("etcd", "cert_file", optional_string, None,
            'cert_file = "/etc/elasticd/tls/client.pem"'),
        Key("etcd", "key_file", optional_string, None,
            'key_file = "/etc/elasticd/tls/client-key.pem"'),
        Key("etcd", "user", optional_string, None, 'user = "elasticd"'),
        Key("etcd", "password", optional_string, None, 'password = "change-me"'),
        Key("etcd", "password_file", optional_string, None,
            'password_file = "/etc/elasticd/etcd.pw"'),
        Key("etcd", "timeout_s", number(0, lo_open=True, hi=300), 3.0, "timeout_s = 3"),
        Key("etcd", "connect_timeout_s", number(0, lo_open=True), 30.0, "connect_timeout_s = 30"),
        Key("etcd", "election_timeout_s", number(0, lo_open=True, hi=60), 1.0,
            "election_timeout_s = 1"),
        Key("etcd", "data_dir", optional_string, None, 'data_dir = "/var/lib/elasticd/etcd"'),
        Key("etcd", "insecure_allow_plaintext_auth", boolean, False,
            "insecure_allow_plaintext_auth = true"),
        Key("node", "id", optional_string, None, 'id = "gpu-node-07"'),
        Key("node", "local_addr", host_or_addr, None, 'local_addr = "10.0.0.7"'),
        Key("node", "ttl_s", lease_ttl, 5, "ttl_s = 5"),
        Key("rendezvous", "join_timeout_s", number(0, lo_open=True), 600.0, "join_timeout_s = 600"),
        Key("rendezvous", "last_call_timeout_s", number(0), 1.0, "last_call_timeout_s = 1"),
        Key("rendezvous", "start_settle_s", number(0), 1.0, "start_settle_s = 1"),
        Key("rendezvous", "close_timeout_s", number(0, lo_open=True), 30.0, "close_timeout_s = 30"),
        Key("rendezvous", "store_timeout_s", number(0, lo_open=True), 300.0,
            "store_timeout_s = 300"),
        Key("rendezvous", "liveness_probe", boolean, True, "liveness_probe = false"),
        Key("rendezvous", "valid_sizes", node_counts, None, "valid_sizes = [2, 4, 8]"),
        Key("rendezvous", "global_batch_size", integer(0), 0, "global_batch_size = 256"),
        Key("rendezvous", "hang_eject_s", number(0, hi=3600), 2.0, "hang_eject_s = 2"),
        Key("rendezvous", "straggler_factor", straggler_factor, 1.25, "straggler_factor = 1.25"),
        Key("rendezvous", "straggler_window_s", number(1, hi=86400), 30.0, "straggler_window_s = 30"),
        Key("rendezvous", "straggler_probation_s", number(0, hi=86400), 60.0,
            "straggler_probation_s = 60"),
        Key("workers", "command", command, REQUIRED, 'command = ["train.py", "--epochs", "10"]'),
        Key("workers", "nproc_per_node", nproc, 1, 'nproc_per_node = "gpu"'),
        Key("workers", "workdir", optional_string, None, 'workdir = "/srv/train"'),
        Key("workers", "env", lambda v, t: v, {}, 'OMP_NUM_THREADS = "4"'),
        Key("workers", "monitor_interval_s", number(0, lo_open=True, hi=60), 0.1,
            "monitor_interval_s = 0.1"),
        Key("workers", "hang_timeout_s", hang_timeout, 0.0, "hang_timeout_s = 1800"),
        Key("workers", "warm_start", boolean, True, "warm_start = false"),
        Key("workers", "standby_refill", boolean, True, "standby_refill = false"),
        Key("workers", "spare_prebuild", boolean, False, "spare_prebuild = true"),
        Key("workers", "live_reform", boolean, True, "live_reform = false"),
        Key("workers", "live_reform_timeout_s", number(0, lo_open=True), 30.0,
            "live_reform_timeout_s = 30"),
        Key("workers", "user", optional_string, None, 'user = "trainer"'),
        Key("restart", "max_restarts", integer(0), 3, "max_restarts = 3"),
        Key("restart", "backoff_s", number(0), 1.0, "backoff_s = 1"),
        Key("restart", "backoff_max_s", number(0), 30.0, "backoff_max_s = 30"),
        Key("drain", "grace_s", number(0, lo_open=True), 60.0, "grace_s = 60"),
        Key("drain", "resize_grace_s", number(0), 30.0, "resize_grace_s = 30"),
        Key("drain", "plain_stop_s", number(0, lo_open=True), 3.0, "plain_stop_s = 3"),
        Key("drain", "done_exit_s", number(0, lo_open=True), 30.0, "done_exit_s = 30"),
        Key("preemption", "provider", choice(*PROVIDERS), "none", 'provider = "aws"'),
        Key("preemption", "base_url", http_url, None, 'base_url = "http://169.254.169.254"'),
        Key("preemption", "poll_interval_s", number(0, lo_open=True, hi=60), 2.0,
            "poll_interval_s = 2"),
        Key("preemption", "drain_lead_s", number(0, hi=3600), None, "drain_lead_s = 60"),
        Key("logging", "format", choice(*LOG_FORMATS), "auto", 'format = "json"'),
        Key("logging", "level", choice(*LOG_LEVELS), "info", 'level = "info"'),
        Key("logging", "worker_log_dir", optional_string, None,
            'worker_log_dir = "/var/log/elasticd/workers"'),
        Key("metrics", "port", integer(0, 65535), 0, "port = 9400"),
        Key("metrics", "addr", listen_addr, "127.0.0.1", 'addr = "127.0.0.1"'),
    )
}


def format_value(value: Any) -> str:
    """Spell ``value`` as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # JSON strings without \u escapes of non-ASCII are valid TOML basic strings.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {value!r} as TOML")


def node_id_from_hostname(hostname: str | None = None) -> str:
    """Derive the default node id from the host name (characters outside
    ``[A-Za-z0-9_.:-]`` become ``-``; at most 128 characters)."""
    name = hostname if hostname is not None else socket.gethostname()
    name = re.sub(r"[^A-Za-z0-9_.:-]", "-", name).strip("-.")[:128]
    return name or "node"


def standalone_job_name(command: tuple[str, ...], workdir: str) -> str:
    """The default name of a standalone job: the script (or module) and a hash of where it is.

    ``("train.py", "--lr", "1")`` in ``/home/ana/exp1`` -> ``train-1a2b3c4d``: stable for
    the same script in the same directory (a rerun finds its own checkpoints), different
    for another directory or script (two runs never share a job by accident).

    Args:
        command: ``workers.command`` (script and arguments, or ``-m module ...``).
        workdir: the directory the script is resolved from.
    """
    if command[:1] == ("-m",) and len(command) > 1:
        target, stem = f"-m {command[1]}", command[1].rsplit(".", 1)[-1]
    elif command:
        target = os.path.normpath(os.path.join(workdir, command[0]))
        stem = os.path.splitext(os.path.basename(command[0]))[0]
    else:
        target, stem = "", "job"
    digest = hashlib.sha256(f"{os.path.abspath(workdir)}\0{target}".encode()).hexdigest()[:8]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", stem).strip("-.")[:40] or "job"
    return f"{stem}-{digest}"
