"""Loading the agent configuration: merge file, environment and flags, then validate.

See the package docstring (elasticd/config/__init__.py) for precedence, the
environment mapping and the override key names.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from elasticd import boundedjson
from elasticd.config.checks import validate_config
from elasticd.config.model import (
    MASK,
    AgentConfig,
    CheckpointConfig,
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
from elasticd.errors import ConfigError, shown
from elasticd.sensitive import mask_value, scrub_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "ELASTICD_"
# Variables the agent sets for its workers whose names fall in a config section's prefix:
# a worker that starts an agent (a test, a nested job) inherits them; they are not config.
WORKER_SIDE_ENV = frozenset({"ELASTICD_CHECKPOINT_URL"})
# A config file is a few kilobytes; the bound makes `--config /dev/zero` (or a log file
# given by mistake) fail at once instead of reading forever.
MAX_CONFIG_BYTES = 1024 * 1024
MAX_CONFIG_DEPTH = 16  # [section] -> key -> a table or array or two: nothing deeper is ours
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
    if values["job.standalone"] and values["job.checkpoint_url"] is None:
        # Where examples/train.py and ElasticLoop save by default (./checkpoints in the
        # workers' directory), told to the agent too: its start-up check sees a re-run's
        # checkpoints before any worker starts (elasticd.agent.standalone_runs).
        where = os.path.join(os.getcwd(), values["workers.workdir"] or "", "checkpoints")
        values["job.checkpoint_url"] = "file://" + os.path.abspath(where)
        origins["job.checkpoint_url"] = "default (standalone: ./checkpoints)"
    if values["job.standalone"] and values["node.local_addr"] is None:
        values["node.local_addr"] = "127.0.0.1"  # workers of one machine talk over loopback
        origins["node.local_addr"] = "default (standalone)"
    if values["node.id"] is None:
        values["node.id"] = node_id_from_hostname(hostname)
        origins["node.id"] = "default (host name)"
    config = _build(values, origins, path)
    validate_config(config, check_files=check_files)
    return config


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
            if value is None and key.dotted == "preemption.drain_lead_s":
                live = config.workers.live_reform
                path = "under live re-formation" if live else "on the restart path"
                lines.append(f"# {key.name} = (unset: {config.preemption.lead_s(live):g} s {path})"
                             f"  # {origin}")
            elif value is None:
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
        try:
            blob = boundedjson.read_file(path, max_bytes=MAX_CONFIG_BYTES)
        except boundedjson.NotRegularFileError:
            raise ConfigError(
                f"config file {path!r} is not a regular file (a FIFO, a socket or a "
                "device); pass the path of the TOML file (examples in agents/)"
            ) from None
        except boundedjson.BoundedJSONError:
            raise ConfigError(
                f"config file {path!r} is larger than {MAX_CONFIG_BYTES // 1024} KiB, so not an "
                "elasticd config; pass the path of the TOML file (examples in agents/)"
            ) from None
        try:
            data = tomllib.loads(blob.decode("utf-8"))
            boundedjson.check_depth(data, what=f"config file {path!r}", max_depth=MAX_CONFIG_DEPTH)
        except (RecursionError, boundedjson.BoundedJSONError):
            raise ConfigError(
                f"config file {path!r} nests tables or arrays deeper than {MAX_CONFIG_DEPTH}, "
                "so it is not an elasticd config; an elasticd config is [section] tables of "
                "keys (examples in agents/)"
            ) from None
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
            hint = closest(section, list(SECTIONS))
            did_you_mean = f"did you mean [{hint}]? " if hint else ""
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
        if section not in SECTIONS or not name or var in WORKER_SIDE_ENV:
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


def closest(word: str, choices: list[str]) -> str | None:
    """The choice ``word`` was most likely meant to be (a typo), or None. Pure.

    One rule for every "did you mean": config keys and sections here, command-line flags
    and subcommands in ``elasticd.cli``.
    """
    hint = difflib.get_close_matches(word, choices, n=1)
    return hint[0] if hint else None


def _unknown_key(section: str, name: str, origin: str) -> str:
    """Say that ``section.name`` is unknown and suggest the closest real key."""
    dotted = f"{section}.{name}" if section else name
    in_section = [k.name for k in KEYS.values() if k.section == section]
    close = [f"{section}.{n}" for n in [closest(name, in_section)] if n]
    if not close:  # the right key in the wrong section?
        close = [k.dotted for k in KEYS.values() if k.name == name]
    if not close:
        names = {k.name: k.dotted for k in KEYS.values()}
        close = [names[n] for n in [closest(name, list(names))] if n]
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
        quoted = scrub_text(shown(mask_value(key.dotted, value)))
        raise ConfigError(f"{key.dotted} = {quoted} ({origin}): {exc.problem}; {fix}") from None


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
        checkpoint=CheckpointConfig(**section("checkpoint")),
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
