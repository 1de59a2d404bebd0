"""Command-line flags as the top layer of the configuration.

Why: ``elasticd run`` and ``elasticd agent`` used to build their settings in two ways,
with defaults and checks of their own; keys validated in a TOML file were silently
dropped on the way to the runtime, and the same flag accepted different values in each
command. Now every flag is only a spelling of a schema key (``dest`` is the dotted key,
the default is ``None`` = "not given"), so the schema's parsers, bounds and defaults are
the only ones, for every way in: TOML < ``ELASTICD_*`` < flags (and ``--rdzv-conf``
under torchrun, see ``elasticd.rendezvous.registry``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elasticd.config.schema import (
    KEYS,
    LOG_FORMATS,
    LOG_LEVELS,
    PROVIDERS,
    REQUIRED,
    RESUME_MODES,
    format_value,
)


@dataclass(frozen=True)
class Flag:
    """One command-line spelling of a schema key."""

    option: str
    dotted: str
    help: str
    metavar: str | None = None
    const: str | None = None  # a switch: sets the key to this text
    choices: tuple[str, ...] | None = None


# Keys with no flag on purpose: workers.command is the positional SCRIPT, workers.env is a
# table (use the environment or [workers.env]), etcd.password must never be on a command
# line (it shows in `ps`): use --etcd-password-file.
NO_FLAG = frozenset({"workers.command", "workers.env", "etcd.password"})

FLAGS: tuple[Flag, ...] = (
    Flag("--standalone", "job.standalone", "one machine: start a private embedded etcd",
         const="true"),
    Flag("--job", "job.name", "job name (letters, digits, -_.; default with --standalone: "
         "derived from the script and the directory)"),
    Flag("--nnodes", "job.nnodes", "N or MIN:MAX nodes (default 1)"),
    Flag("--checkpoint-url", "job.checkpoint_url",
         "fsspec URL handed to workers as ELASTICD_CHECKPOINT_URL (default with --standalone: "
         "file://$PWD/checkpoints)", metavar="URL"),
    Flag("--checkpoint-every", "checkpoint.every",
         'steps between ElasticLoop saves, or "auto": Young-Daly over the measured save '
         "cost and the job's loss rate, <= 1 %% overhead (default: the script's save_every)",
         metavar="auto|STEPS"),
    Flag("--resume", "job.resume", "another run's checkpoints under the same URL and job: "
         "auto refuses to start (exit 78), require resumes the newest, never ignores them",
         choices=RESUME_MODES),
    Flag("--etcd", "etcd.endpoints", "etcd endpoints, comma-separated",
         metavar="HOST:PORT[,...]"),
    Flag("--etcd-ca", "etcd.ca_file", "CA bundle for TLS to etcd", metavar="FILE"),
    Flag("--etcd-cert", "etcd.cert_file", "client certificate for TLS", metavar="FILE"),
    Flag("--etcd-key", "etcd.key_file", "client key for TLS", metavar="FILE"),
    Flag("--etcd-user", "etcd.user", "etcd user (auth)", metavar="USER"),
    Flag("--etcd-password-file", "etcd.password_file", "file holding the etcd password",
         metavar="FILE"),
    Flag("--etcd-insecure-plaintext-auth", "etcd.insecure_allow_plaintext_auth",
         "INSECURE: send the etcd password without TLS (trusted networks only)", const="true"),
    Flag("--etcd-timeout", "etcd.timeout_s", "timeout of one etcd call, s", metavar="S"),
    Flag("--etcd-connect-timeout", "etcd.connect_timeout_s",
         "how long to wait for etcd at start, s", metavar="S"),
    Flag("--etcd-election-timeout", "etcd.election_timeout_s",
         "the etcd members' --election-timeout, s (node TTL must be >= 3x it)", metavar="S"),
    Flag("--etcd-data-dir", "etcd.data_dir", "data dir of the embedded etcd (default: a new "
         "temporary dir)", metavar="DIR"),
    Flag("--node-id", "node.id", "this node's id (default: the host name)"),
    Flag("--local-addr", "node.local_addr", "address peers use to reach this node's workers",
         metavar="ADDR"),
    Flag("--node-ttl", "node.ttl_s", "lease TTL, s: a dead node is seen this fast (min 2)",
         metavar="S"),
    Flag("--join-timeout", "rendezvous.join_timeout_s", "max wait for a round, s", metavar="S"),
    Flag("--last-call-timeout", "rendezvous.last_call_timeout_s",
         "wait this long for stragglers once MIN nodes joined, s", metavar="S"),
    Flag("--start-settle", "rendezvous.start_settle_s",
         "the job's first round stays open this long once MIN nodes joined (MIN < MAX), so "
         "nodes started together train together, s", metavar="S"),
    Flag("--close-timeout", "rendezvous.close_timeout_s",
         "how long closing a finished job's rendezvous may take, s", metavar="S"),
    Flag("--store-timeout", "rendezvous.store_timeout_s",
         "timeout of the round's c10d store (workers' init_process_group), s", metavar="S"),
    Flag("--no-liveness-probe", "rendezvous.liveness_probe",
         "publish no liveness probe and probe no peer (a firewall that rejects makes a live "
         "node look dead): a killed peer is seen when its lease expires", const="false"),
    Flag("--valid-sizes", "rendezvous.valid_sizes",
         "node counts a round may form at, e.g. 2,4,8 (default: every count in --nnodes); "
         "nodes beyond the largest valid count reached wait as spares", metavar="N[,N...]"),
    Flag("--global-batch", "rendezvous.global_batch_size",
         "valid node counts are those whose workers split this global batch evenly "
         "(0 = no such rule)", metavar="N"),
    Flag("--hang-eject", "rendezvous.hang_eject_s",
         "eject a node whose workers hang the job after this long without progress "
         "(at least 5 step times; 0=off), s", metavar="S"),
    Flag("--straggler-factor", "rendezvous.straggler_factor",
         "flag a node whose own step time stays this many times the median's (0=off)",
         metavar="X"),
    Flag("--straggler-window", "rendezvous.straggler_window_s",
         "... on 4 in 5 looks over this window before it is flagged, s", metavar="S"),
    Flag("--straggler-probation", "rendezvous.straggler_probation_s",
         "eject a flagged straggler when the job is faster without it and keep it a spare "
         "this long (doubling if flagged again; live re-formation only; 0=flag only), s",
         metavar="S"),
    Flag("--nproc-per-node", "workers.nproc_per_node", "workers on this node: N, 'gpu' or 'auto'",
         metavar="N"),
    Flag("--workdir", "workers.workdir", "working directory of the workers", metavar="DIR"),
    Flag("--monitor-interval", "workers.monitor_interval_s", "how often workers are checked, s",
         metavar="S"),
    Flag("--hang-timeout", "workers.hang_timeout_s", "restart if no step for this long (0=off), s",
         metavar="S"),
    Flag("--no-warm-start", "workers.warm_start",
         "start every worker cold (no standby processes that have imported torch)", const="false"),
    Flag("--no-standby-refill", "workers.standby_refill",
         "start no new standbys once the workers run (only the first workers start warm)",
         const="false"),
    Flag("--spare-prebuild", "workers.spare_prebuild",
         "a hot spare's workers start the script before their admission and wait in "
         "the worker API with the model built", const="true"),
    Flag("--no-live-reform", "workers.live_reform",
         "restart workers on every membership change, even those on the worker API", const="false"),
    Flag("--live-reform-timeout", "workers.live_reform_timeout_s",
         "an in-place re-formation not done within this falls back to a restart, s", metavar="S"),
    Flag("--workers-user", "workers.user",
         "run the workers as this user (uid, gid, groups); the agent must run as root",
         metavar="USER"),
    Flag("--max-restarts", "restart.max_restarts", "worker-failure restarts (default 3)",
         metavar="N"),
    Flag("--restart-backoff", "restart.backoff_s", "first restart backoff, s", metavar="S"),
    Flag("--restart-backoff-max", "restart.backoff_max_s", "largest restart backoff, s",
         metavar="S"),
    Flag("--drain-grace", "drain.grace_s", "on a stop, workers get this long to save, s",
         metavar="S"),
    Flag("--resize-grace", "drain.resize_grace_s",
         "on a join, workers get this long to stop at a step boundary (0=restart at once), s",
         metavar="S"),
    Flag("--plain-stop", "drain.plain_stop_s",
         "on a stop, workers that never called should_stop() get this long, then SIGKILL, s",
         metavar="S"),
    Flag("--done-exit", "drain.done_exit_s",
         "workers whose script returned but that are still running this much later are "
         "stopped and counted done, s", metavar="S"),
    Flag("--preemption", "preemption.provider", "watch this cloud's preemption notices",
         choices=PROVIDERS),
    Flag("--preemption-url", "preemption.base_url", "metadata service URL (tests, proxies)",
         metavar="URL"),
    Flag("--preemption-poll", "preemption.poll_interval_s", "metadata poll interval, s",
         metavar="S"),
    Flag("--drain-lead", "preemption.drain_lead_s",
         "on a notice, train on until this many seconds are left before its deadline, then "
         "drain, s", metavar="S"),
    Flag("--log-format", "logging.format", "agent log format", choices=LOG_FORMATS),
    Flag("--log-level", "logging.level", "agent log level", choices=LOG_LEVELS),
    Flag("--log-dir", "logging.worker_log_dir", "where worker logs go (default: "
         "$STATE_DIRECTORY/worker-logs/JOB, else a private temp dir)", metavar="DIR"),
    Flag("--metrics-port", "metrics.port", "serve Prometheus metrics on this port (0=off)",
         metavar="PORT"),
    Flag("--metrics-addr", "metrics.addr", "address the metrics exporter binds", metavar="ADDR"),
)


# The argument groups of ``--help``, one per config section, in the schema's order.
SECTION_TITLES = {
    "job": "job ([job])", "checkpoint": "checkpoints ([checkpoint])",
    "etcd": "etcd connection ([etcd])", "node": "this node ([node])",
    "rendezvous": "rendezvous ([rendezvous])", "workers": "workers ([workers])",
    "restart": "restarts ([restart])", "drain": "stopping and resizing ([drain])",
    "preemption": "preemption notices ([preemption])", "logging": "logging ([logging])",
    "metrics": "metrics ([metrics])",
}


def flag_help(f: Flag) -> str:
    """A flag's help with the schema default appended (``(default: 5)``), unless the text
    already names its default or the flag is a switch (its help says what it turns). Pure."""
    default = KEYS[f.dotted].default
    if (f.const is not None or "default" in f.help or default is None or default is REQUIRED
            or default in ((), [], "")):
        return f.help
    shown = (default if isinstance(default, str) else f"{default:g}"
             if isinstance(default, float) else format_value(default))
    return f"{f.help} (default: {shown})".replace("%", "%%")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per schema key (see :data:`FLAGS`), all defaulting to "not given",
    in one argument group per config section (``--help`` shows each key's default)."""
    groups: dict[str, Any] = {}
    for f in FLAGS:
        section = f.dotted.split(".", 1)[0]
        if section not in groups:
            groups[section] = parser.add_argument_group(SECTION_TITLES.get(section, section))
        group = groups[section]
        alias = underscore_alias(f.option)
        if f.const is not None:
            group.add_argument(f.option, dest=f.dotted, action="store_const", const=f.const,
                               default=None, help=f.help.replace("%", "%%"))
            if alias:
                group.add_argument(alias, dest=f.dotted, action="store_const", const=f.const,
                                   default=None, help=argparse.SUPPRESS)
        else:
            metavar = f.metavar or (None if f.choices else f.option[2:].upper().replace("-", "_"))
            group.add_argument(f.option, dest=f.dotted, default=None, help=flag_help(f),
                               metavar=metavar, choices=f.choices)
            if alias:
                group.add_argument(alias, dest=f.dotted, default=None, help=argparse.SUPPRESS,
                                   metavar=metavar, choices=f.choices)


def underscore_alias(option: str) -> str | None:
    """torchrun's underscore spelling of a flag (``--nproc_per_node`` for
    ``--nproc-per-node``), or None for a one-word flag. Pure.

    Why: torchrun accepts both spellings of each of its flags, and scripts and job files
    written for it use the underscore one; refusing it (exit 78, the top-level usage) was
    the first thing a torchrun user met. The alias is hidden from ``--help``.
    """
    alias = "--" + option[2:].replace("-", "_")
    return alias if alias != option else None


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that were given, as ``{dotted key: text}`` for ``load_config``."""
    given: Mapping[str, Any] = vars(args)
    return {f.dotted: given[f.dotted] for f in FLAGS if given.get(f.dotted) is not None}


def flag_names() -> dict[str, str]:
    """``{dotted key: "flag --option"}``, so errors name the flag the user typed."""
    return {f.dotted: f"flag {f.option}" for f in FLAGS}
