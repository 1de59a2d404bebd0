"""Loading the agent configuration: merge file, environment and flags, then validate.

See the package docstring (elasticd/config/__init__.py) for precedence, the
environment mapping and the override key names.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from elasticd.config.model import (
    MASK,
    AgentConfig,
    DrainConfig,
    EtcdConfig,
    JobConfig,
    LoggingConfig,
    MetricsConfig,
    NodeConfig,
    PreemptionConfig,
    RendezvousConfig,
    RestartConfig,
    WorkersConfig,
)
from elasticd.config.schema import (
    KEYS,
    REQUIRED,
    SECTIONS,
    UNQUOTE,
    Invalid,
    Key,
    format_value,
    node_id_from_hostname,
    standalone_job_name,
)
from elasticd.errors import ConfigError
from elasticd.keys import validate_job_name, validate_node_id
from elasticd.sensitive import loose_secret_file, mask_value, scrub_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "ELASTICD_"
# A config file is a few kilobytes; the bound makes `--config /dev/zero` (or a log file
# given by mistake) fail at once instead of reading forever.
MAX_CONFIG_BYTES = 1024 * 1024
# Variables the agent sets for every worker itself; a value from [workers.env] would
# be silently overwritten, so it is refused up front.
RESERVED_WORKER_ENV = frozenset(
    {
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    }
)


def load_config(
    path: str | None,
    env: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
    *,
    check_files: bool = True,
    require_command: bool = True,
    hostname: str | None = None,
    override_names: Mapping[str, str] | None = None,
) -> AgentConfig:
    """Load, merge and validate the agent configuration.

    Args:
        path: TOML file, or None for defaults + environment + overrides only.
        env: the process environment (pass ``os.environ``); only ``ELASTICD_*`` is read.
        overrides: dotted ``section.key`` -> value from the command line (see the
            module docstring); ``None`` values are skipped.
        check_files: check that TLS, password and workdir paths exist and are
            readable. Turn off only to validate a config meant for another machine.
        require_command: require ``workers.command`` (the agent needs it; read-only
            tools such as ``elasticd status`` do not).
        hostname: host name the default ``node.id`` is derived from; defaults to
            ``socket.gethostname()``.
        override_names: how the user spelled each override (``{"job.nnodes": "flag
            --nnodes"}``), named in error messages instead of "override".

    Returns:
        The frozen, validated :class:`AgentConfig`.

    Raises:
        ConfigError: one message naming the key (``section.key``), its value and
            where it came from, and how to fix it.
    """
    raw: dict[str, tuple[Any, str, bool]] = {}  # dotted -> (value, origin, is_text)
    worker_env: dict[str, tuple[Any, str]] = {}
    if path is not None:
        _merge_file(path, raw, worker_env)
    _merge_env(env, raw)
    _merge_overrides(overrides or {}, raw, worker_env, override_names or {})

    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for key in KEYS.values():
        if key.dotted == "workers.env":
            continue
        if key.dotted in raw:
            value, origin, text = raw[key.dotted]
            values[key.dotted] = _parse(key, value, origin, text)
            origins[key.dotted] = origin
        elif key.dotted == "job.name" and _standalone(raw):
            values[key.dotted] = None  # derived from the command below
            origins[key.dotted] = "default (standalone: script and directory)"
        elif key.default is REQUIRED and (key.dotted != "workers.command" or require_command):
            raise ConfigError(
                f"{key.dotted} is required but not set: add `{key.example}` under "
                f"[{key.section}] in the config file, or set {key.env_var}"
            )
        else:
            values[key.dotted] = () if key.default is REQUIRED else key.default
            origins[key.dotted] = "default"
    values["workers.env"] = _parse_worker_env(worker_env, origins)
    if values["job.name"] is None:
        # Two standalone jobs in different directories (or of different scripts) must not
        # share a name: they would resume from and prune each other's checkpoints.
        values["job.name"] = standalone_job_name(
            values["workers.command"], values["workers.workdir"] or os.getcwd())
    if values["job.standalone"] and values["node.local_addr"] is None:
        values["node.local_addr"] = "127.0.0.1"  # workers of one machine talk over loopback
        origins["node.local_addr"] = "default (standalone)"
    if values["node.id"] is None:
        values["node.id"] = node_id_from_hostname(hostname)
        origins["node.id"] = "default (host name)"
    config = _build(values, origins, path)
    _validate(config, check_files=check_files)
    return config


# node.ttl_s against the etcd members' election timeout E: below 1.5 E a leader stall that
# triggers no election can expire a healthy node's lease (an error); 3 E leaves a keep-alive
# interval of margin (a warning below it).
MIN_TTL_PER_ELECTION = 1.5
SAFE_TTL_PER_ELECTION = 3.0


def availability_warnings(config: AgentConfig) -> list[str]:
    """Settings that keep a job from riding through an etcd member failure (one line each).

    An agent talks to one etcd member at a time and moves to the next listed endpoint when
    a call fails; given one endpoint it has nowhere to go (docs/deployment.md, "The etcd
    cluster: members, failover, backup").
    """
    endpoints, out = config.etcd.endpoints, []
    if len(endpoints) == 1 and not config.etcd.embedded:
        out.append(f"etcd.endpoints names one endpoint ({endpoints[0]}): if etcd runs as a "
                   "cluster, list every member (e.g. --etcd etcd-1:2379,etcd-2:2379,etcd-3:2379) "
                   "so the agent can move to another member when this one fails")
    election, ttl = config.etcd.election_timeout_s, config.node.ttl_s
    if not config.etcd.embedded and ttl < SAFE_TTL_PER_ELECTION * election:
        out.append(f"node.ttl_s = {ttl} is below {SAFE_TTL_PER_ELECTION:g} x "
                   f"etcd.election_timeout_s = {election:g} s: a leader stall just short of an "
                   "election plus one slow keep-alive could drop a healthy node; prefer "
                   f"node.ttl_s >= {math.ceil(SAFE_TTL_PER_ELECTION * election)}")
    return out


def security_warnings(config: AgentConfig) -> list[str]:
    """The insecure settings ``config`` shows, one line each (``--check-config`` prints them).

    None of them is an error: each is a choice an operator may make on purpose, but
    should make knowingly (docs/security.md).
    """
    out: list[str] = []
    etcd, origins = config.etcd, config.origins
    if etcd.insecure_allow_plaintext_auth and etcd.user is not None and not etcd.tls:
        out.append("etcd.insecure_allow_plaintext_auth = true: the etcd password crosses the "
                   "network in clear text; serve etcd over TLS and set etcd.ca_file")
    if etcd.password is not None:
        where = origins.get("etcd.password", "")
        out.append(f"etcd.password is set in the {'environment' if where.startswith('env') else 'config'}"
                   " (readable by whoever reads it, and inherited by child processes); "
                   "use etcd.password_file (chmod 0600) instead")
    if etcd.password_file is not None:
        loose = loose_secret_file(etcd.password_file)
        if loose:
            out.append(f"etcd.password_file: {loose}")
    if etcd.key_file is not None:
        loose = loose_secret_file(etcd.key_file)
        if loose:
            out.append(f"etcd.key_file: {loose}")
    if any(e.startswith("https://") for e in etcd.endpoints) and etcd.ca_file is None:
        out.append("etcd.endpoints are https:// without etcd.ca_file: etcd's certificate is "
                   "verified against the system's root CAs (fine for a publicly signed "
                   "certificate; set etcd.ca_file for a private CA)")
    if not etcd.embedded and not etcd.tls:
        out.append("etcd.endpoints are plaintext (no etcd.ca_file, no https://): anyone on the "
                   "network path can read and change the job's keys; serve etcd over TLS")
    if config.metrics.enabled and config.metrics.addr in ("0.0.0.0", "::"):
        out.append(f"metrics.addr = {config.metrics.addr!r}: the metrics listen on every "
                   "interface; set the address Prometheus scrapes, or 127.0.0.1")
    log_dir = config.logging.worker_log_dir
    if log_dir is not None:
        from elasticd.logs import check_log_root  # keeps structlog out of plain config loads

        try:
            check_log_root(log_dir)
        except ConfigError as exc:
            out.append(f"logging.worker_log_dir: {exc}")
    for name, value in config.workers.env.items():
        if mask_value(name, value) != value:
            out.append(f"workers.env.{name} looks like a secret: every worker (training code) "
                       "sees it; prefer the storage's own credential chain (e.g. instance roles)")
    return out


def render_effective(config: AgentConfig) -> str:
    """Render ``config`` as TOML (secrets masked) with the origin of every value.

    The output loads back with :func:`load_config` (masked secrets aside), so an
    operator can diff it against the file on disk or start from it.
    """
    masked = config.masked()
    values = _flatten(masked)
    where = f" from {config.path}" if config.path else ""
    lines = [f"# effective elasticd configuration{where}; secrets shown as {MASK}"]
    env_table = values.pop("workers.env")
    for section in SECTIONS:
        lines.append("")
        lines.append(f"[{section}]")
        for key in KEYS.values():
            if key.section != section or key.dotted == "workers.env":
                continue
            value = values[key.dotted]
            origin = _short(config.origins.get(key.dotted, "default"))
            if value is None:
                lines.append(f"# {key.name} = (unset)  # {origin}")
            else:
                lines.append(f"{key.name} = {format_value(value)}  # {origin}")
        if section == "workers":
            lines.append("")
            lines.append("[workers.env]")
            for name, value in sorted(env_table.items()):
                origin = _short(config.origins.get(f"workers.env.{name}", "file"))
                lines.append(f"{name} = {format_value(value)}  # {origin}")
    return "\n".join(lines) + "\n"


# --- merging ---------------------------------------------------------------------


def _standalone(raw: Mapping[str, tuple[Any, str, bool]]) -> bool:
    """Whether job.standalone is set (before full parsing, to pick job.name's default)."""
    if "job.standalone" not in raw:
        return False
    value, _, text = raw["job.standalone"]
    try:
        return bool(KEYS["job.standalone"].parse(value, text))
    except Invalid:
        return False  # reported with the key's other errors later


def _merge_file(
    path: str, raw: dict[str, tuple[Any, str, bool]], worker_env: dict[str, tuple[Any, str]]
) -> None:
    try:
        with open(path, "rb") as f:
            blob = f.read(MAX_CONFIG_BYTES + 1)
        if len(blob) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {path!r} is larger than {MAX_CONFIG_BYTES // 1024} KiB, so not an "
                "elasticd config; pass the path of the TOML file (examples in agents/)"
            )
        data = tomllib.loads(blob.decode("utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(
            f"config file {path!r} does not exist; pass the path of an existing TOML file "
            "(examples in agents/), or leave --config out"
        ) from exc
    except OSError as exc:
        raise ConfigError(
            f"config file {path!r} cannot be read ({exc.strerror or exc}); make it a regular "
            "file readable by the agent's user"
        ) from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"config file {path!r} is not valid TOML: {exc}; fix the syntax there "
            '(strings need quotes, e.g. name = "my-run"; sections look like [job])'
        ) from exc
    origin = f"file {path}"
    for section, table in data.items():
        if not isinstance(table, dict):
            if section in SECTIONS:
                raise ConfigError(
                    f"{section} = {table!r} ({origin}): {section} must be a section; write "
                    f"[{section}] on a line of its own with its keys below it"
                )
            raise ConfigError(_unknown_key("", section, origin))
        if section not in SECTIONS:
            hint = difflib.get_close_matches(section, SECTIONS, n=1)
            did_you_mean = f"did you mean [{hint[0]}]? " if hint else ""
            raise ConfigError(
                f"[{section}] ({origin}): unknown section; {did_you_mean}"
                f"the sections are {', '.join('[' + s + ']' for s in SECTIONS)}"
            )
        for name, value in table.items():
            dotted = f"{section}.{name}"
            if dotted == "workers.env":
                if not isinstance(value, dict):
                    raise ConfigError(
                        f"workers.env = {value!r} ({origin}): must be a table of variables; "
                        'write [workers.env] and then lines like OMP_NUM_THREADS = "4"'
                    )
                for var, var_value in value.items():
                    worker_env[var] = (var_value, origin)
                continue
            if dotted not in KEYS:
                raise ConfigError(_unknown_key(section, name, origin))
            raw[dotted] = (value, origin, False)


def _merge_env(env: Mapping[str, str], raw: dict[str, tuple[Any, str, bool]]) -> None:
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        section, _, name = var[len(ENV_PREFIX):].lower().partition("_")
        if section not in SECTIONS or not name:
            continue  # not ours (ELASTICD_SOAK, ELASTICD_CONFIG, worker-side variables)
        value = env[var]
        if value == "":
            continue
        dotted = f"{section}.{name}"
        if dotted == "workers.env":
            raise ConfigError(
                f"{var} is set, but workers.env cannot come from the environment; workers "
                "inherit the agent's environment, so export each variable itself instead"
            )
        if dotted not in KEYS:
            raise ConfigError(_unknown_key(section, name, f"env {var}"))
        raw[dotted] = (value, f"env {var}", True)


def _merge_overrides(
    overrides: Mapping[str, Any],
    raw: dict[str, tuple[Any, str, bool]],
    worker_env: dict[str, tuple[Any, str]],
    names: Mapping[str, str],
) -> None:
    for dotted, value in overrides.items():
        if value is None:
            continue
        if dotted == "workers.env":
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"override workers.env = {value!r}: must be a mapping of variable names "
                    "to values; pass e.g. {'OMP_NUM_THREADS': '4'}"
                )
            for var, var_value in value.items():
                worker_env[var] = (var_value, "override")
            continue
        if dotted not in KEYS:
            section, _, name = dotted.partition(".")
            raise ConfigError(_unknown_key(section, name, "override"))
        raw[dotted] = (value, names.get(dotted, "override"), isinstance(value, str))


def _unknown_key(section: str, name: str, origin: str) -> str:
    """Say that ``section.name`` is unknown and suggest the closest real key."""
    dotted = f"{section}.{name}" if section else name
    in_section = [k.name for k in KEYS.values() if k.section == section]
    close = [f"{section}.{n}" for n in difflib.get_close_matches(name, in_section, n=1)]
    if not close:  # the right key in the wrong section?
        close = [k.dotted for k in KEYS.values() if k.name == name]
    if not close:
        names = {k.name: k.dotted for k in KEYS.values()}
        close = [names[n] for n in difflib.get_close_matches(name, list(names), n=1)]
    head = f"{dotted} ({origin}): unknown key"
    if not close:
        where = f"[{section}] takes {', '.join(in_section)}" if section else "keys go in sections"
        return f"{head}; {where} (see docs/configuration.md)"
    target = KEYS[close[0]]
    spelled = (
        f"{target.env_var} ({target.dotted})" if origin.startswith("env ") else target.dotted
    )
    moved = f" (it goes under [{target.section}])" if target.section != section else ""
    return f"{head}; did you mean {spelled}?{moved}"


def _short(origin: str) -> str:
    """``file /etc/x.toml`` -> ``file`` (the rendered header names the file)."""
    return "file" if origin.startswith("file ") else origin


# --- parsing and building --------------------------------------------------------


def _parse(key: Key, value: Any, origin: str, text: bool) -> Any:
    try:
        return key.parse(value, text)
    except Invalid as exc:
        if exc.fix == UNQUOTE:
            fix = f"write the number without quotes, e.g. `{key.example}`"
        else:
            fix = exc.fix or f"write e.g. `{key.example}`"
        shown = scrub_text(repr(mask_value(key.dotted, value)))
        raise ConfigError(f"{key.dotted} = {shown} ({origin}): {exc.problem}; {fix}") from None


def _parse_worker_env(
    worker_env: Mapping[str, tuple[Any, str]], origins: dict[str, str]
) -> Mapping[str, str]:
    out: dict[str, str] = {}
    for name, (value, origin) in worker_env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
            raise ConfigError(
                f"workers.env.{name} ({origin}): not a valid environment variable name; "
                "use letters, digits and '_' and do not start with a digit"
            )
        if name in RESERVED_WORKER_ENV:
            raise ConfigError(
                f"workers.env.{name} = {value!r} ({origin}): the agent sets {name} for each "
                "worker itself; remove it from [workers.env]"
            )
        if isinstance(value, bool):
            value = "1" if value else "0"
        elif isinstance(value, (int, float)):
            value = str(value)
        elif not isinstance(value, str):
            raise ConfigError(
                f"workers.env.{name} = {value!r} ({origin}): must be a string or number; "
                f'write {name} = "value"'
            )
        out[name] = value
        origins[f"workers.env.{name}"] = origin
    return MappingProxyType(out)


def _build(values: Mapping[str, Any], origins: Mapping[str, str], path: str | None) -> AgentConfig:
    def section(name: str) -> dict[str, Any]:
        prefix = name + "."
        return {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}

    job = section("job")
    min_nodes, max_nodes = job.pop("nnodes")
    return AgentConfig(
        job=JobConfig(min_nodes=min_nodes, max_nodes=max_nodes, **job),
        etcd=EtcdConfig(**section("etcd")),
        node=NodeConfig(**section("node")),
        workers=WorkersConfig(**section("workers")),
        rendezvous=RendezvousConfig(**section("rendezvous")),
        restart=RestartConfig(**section("restart")),
        drain=DrainConfig(**section("drain")),
        preemption=PreemptionConfig(**section("preemption")),
        logging=LoggingConfig(**section("logging")),
        metrics=MetricsConfig(**section("metrics")),
        origins=MappingProxyType(dict(origins)),
        path=path,
    )


def _flatten(config: AgentConfig) -> dict[str, Any]:
    """Inverse of :func:`_build`: dotted key -> value, as TOML would spell it."""
    out: dict[str, Any] = {}
    for section in SECTIONS:
        obj = getattr(config, section)
        for key in KEYS.values():
            if key.section != section:
                continue
            if key.dotted == "job.nnodes":
                out[key.dotted] = f"{obj.min_nodes}:{obj.max_nodes}"
            else:
                out[key.dotted] = getattr(obj, key.name)
    return out


# --- cross-key validation --------------------------------------------------------


def _validate(config: AgentConfig, *, check_files: bool) -> None:
    """Checks that involve more than one key, or the file system."""
    origins = config.origins

    def bad(dotted: str, value: Any, problem_and_fix: str) -> ConfigError:
        shown = scrub_text(repr(mask_value(dotted, value)))
        return ConfigError(f"{dotted} = {shown} ({origins.get(dotted, 'default')}): {problem_and_fix}")

    job, etcd, node, workers = config.job, config.etcd, config.node, config.workers
    try:
        validate_job_name(job.name)
    except ConfigError as exc:
        raise bad("job.name", job.name, str(exc)) from None
    try:
        validate_node_id(node.id)
    except ConfigError as exc:
        raise bad("node.id", node.id, f"{exc}; set [node] id explicitly") from None
    if job.standalone and etcd.endpoints:
        raise bad(
            "job.standalone", True,
            "a standalone job uses an embedded etcd, but etcd.endpoints is set too; "
            "remove etcd.endpoints, or set standalone = false for a multi-node job",
        )
    if job.standalone and job.max_nodes > 1:
        raise bad(
            "job.standalone", True,
            f'a standalone job runs on one node, but job.nnodes allows {job.max_nodes}; '
            'set nnodes = 1, or standalone = false with etcd.endpoints',
        )
    if etcd.embedded and not job.standalone and job.max_nodes > 1:
        raise bad(
            "job.nnodes", f"{job.min_nodes}:{job.max_nodes}",
            "etcd.endpoints is empty, so this agent starts a private etcd on 127.0.0.1 "
            "that no other node can reach; set etcd.endpoints to an etcd all nodes share, "
            "or nnodes = 1 for a one-machine job",
        )
    if node.ttl_s < MIN_TTL_PER_ELECTION * etcd.election_timeout_s:
        # A leader stalled for S < election timeout E triggers no election (no new leader
        # restarts the TTLs) and answers no keep-alive meanwhile; a lease last renewed up
        # to TTL/3 before the stall expires once TTL/3 + S >= TTL. So TTL >= 1.5 E, or a
        # healthy node is dropped as "lost" (docs/deployment.md, the TTL rule).
        raise bad(
            "node.ttl_s", node.ttl_s,
            f"shorter than {MIN_TTL_PER_ELECTION:g} x etcd.election_timeout_s = "
            f"{etcd.election_timeout_s:g} s: a leader stall too short to trigger an election "
            "could expire a healthy node's lease; set node.ttl_s >= "
            f"{math.ceil(SAFE_TTL_PER_ELECTION * etcd.election_timeout_s)} (or lower the members' "
            "--election-timeout and etcd.election_timeout_s with it)",
        )
    if config.restart.backoff_max_s < config.restart.backoff_s:
        raise bad(
            "restart.backoff_max_s", config.restart.backoff_max_s,
            f"smaller than restart.backoff_s = {config.restart.backoff_s}; "
            "make backoff_max_s >= backoff_s",
        )
    if etcd.password is not None and etcd.password_file is not None:
        raise bad(
            "etcd.password_file", etcd.password_file,
            "etcd.password is set too; keep only one (password_file keeps the secret "
            "out of the config and the environment)",
        )
    has_password = etcd.password is not None or etcd.password_file is not None
    if has_password and etcd.user is None:
        key = "etcd.password" if etcd.password is not None else "etcd.password_file"
        raise bad(key, MASK if key == "etcd.password" else etcd.password_file,
                  "a password needs a user; set etcd.user too")
    if etcd.user is not None and not has_password:
        raise bad("etcd.user", etcd.user,
                  "a user needs a password; set etcd.password_file (or etcd.password)")
    if (etcd.cert_file is None) != (etcd.key_file is None):
        given, missing = (
            ("etcd.cert_file", "etcd.key_file") if etcd.cert_file else
            ("etcd.key_file", "etcd.cert_file")
        )
        raise bad(given, getattr(etcd, given.split(".")[1]),
                  f"client TLS needs both a certificate and its key; set {missing} too")
    if etcd.cert_file is not None and etcd.ca_file is None:
        raise bad("etcd.cert_file", etcd.cert_file,
                  "client certificates are only sent over TLS; set etcd.ca_file too")
    if etcd.embedded:
        for dotted in ("etcd.ca_file", "etcd.cert_file", "etcd.user"):
            value = getattr(etcd, dotted.split(".")[1])
            if value is not None:
                raise bad(
                    dotted, value,
                    "etcd.endpoints is empty, so the agent starts a private embedded etcd "
                    "(TLS with its own generated client certificate) and this would be "
                    "ignored; set etcd.endpoints to "
                    "your etcd cluster, or remove the key",
                )
    elif etcd.user is not None and not etcd.tls and not etcd.insecure_allow_plaintext_auth:
        raise bad(
            "etcd.user", etcd.user,
            "a user and password without TLS would cross the network in clear text; serve "
            "etcd over TLS and set etcd.ca_file (or write the endpoints https:// for a "
            "publicly signed certificate), or, on a network you trust, opt in with "
            "etcd.insecure_allow_plaintext_auth = true",
        )
    if check_files:
        for dotted in ("etcd.ca_file", "etcd.cert_file", "etcd.key_file", "etcd.password_file"):
            file_path = getattr(etcd, dotted.split(".")[1])
            if file_path is not None and not (
                os.path.isfile(file_path) and os.access(file_path, os.R_OK)
            ):
                raise bad(dotted, file_path,
                          "no such readable file; fix the path or the file's permissions "
                          "for the agent's user")
        if etcd.password_file is not None:
            try:
                etcd.resolved_password()
            except ConfigError as exc:
                raise ConfigError(f"{exc} ({origins.get('etcd.password_file')})") from None
        log_dir = config.logging.worker_log_dir
        if log_dir is not None:
            from elasticd.logs import check_log_root

            check_log_root(log_dir)
        if workers.workdir is not None and not os.path.isdir(workers.workdir):
            raise bad("workers.workdir", workers.workdir,
                      "no such directory; create it or fix the path")


