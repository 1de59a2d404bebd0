"""``elasticd agent``: the node daemon, driven by a TOML config (systemd's ExecStart).

Precedence: TOML < ``ELASTICD_*`` environment < flags. ``--check-config`` validates and
prints the effective configuration (secrets masked) without starting anything, and warns
on stderr about each insecure setting it sees (docs/security.md). The flags are the same as
``elasticd run``'s (``elasticd.config.flags``): each is one schema key.
"""

from __future__ import annotations

import argparse
import os
import sys

from elasticd.config import AgentConfig, load_config, render_effective, security_warnings
from elasticd.config.checks import availability_warnings
from elasticd.config.flags import add_config_flags, flag_names, overrides_from_args


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("agent", help="run the node agent from a config file (systemd)",
                       description="Run the elasticd node agent. Keys: docs/configuration.md.")
    p.add_argument("--config", "-c", help="TOML config file (e.g. /etc/elasticd/elasticd.toml)")
    p.add_argument("--check-config", action="store_true",
                   help="validate, print the effective config (secrets masked) and exit")
    add_config_flags(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    path = args.config or os.environ.get("ELASTICD_CONFIG")
    cfg = load_config(path, os.environ, overrides_from_args(args),
                      override_names=flag_names())
    if args.check_config:
        _refuse_what_the_start_refuses(cfg)
        sys.stdout.write(render_effective(cfg))
        # stderr: stdout stays a loadable TOML file; each warning names the setting and the fix.
        for warning in security_warnings(cfg):
            sys.stderr.write(f"elasticd: warning: insecure setting: {warning}\n")
        for warning in availability_warnings(cfg):
            sys.stderr.write(f"elasticd: warning: no etcd fail-over: {warning}\n")
        return 0
    # The first standbys start importing torch now; then the stop/drain check (`elasticd
    # stop`/`drain`: exit 0 at once) and the agent's own torch import (elasticd.agent.early).
    from elasticd.agent.early import run_node_with_early_standbys

    return run_node_with_early_standbys(cfg)


def _refuse_what_the_start_refuses(cfg: AgentConfig) -> None:
    """The start's own checks of what the config names on this machine, so that
    ``--check-config`` passes only what the start accepts.

    Raises:
        ConfigError: a root or missing ``workers.user``; an etcd TLS file that is not a
            readable PEM file; an existing ``etcd.data_dir`` owned by another user.
    """
    if cfg.workers.user is not None:
        from elasticd.agent.worker_user import resolve_worker_user

        resolve_worker_user(cfg.workers.user, euid=os.geteuid())
    from elasticd.etcd.embedded import check_private_dir
    from elasticd.etcd.endpoints import read_tls_file

    for path, what in ((cfg.etcd.ca_file, "CA file"), (cfg.etcd.cert_file, "client certificate"),
                       (cfg.etcd.key_file, "client key")):
        if path is not None:
            read_tls_file(path, what)
    if cfg.etcd.data_dir is not None and os.path.exists(cfg.etcd.data_dir):
        check_private_dir(cfg.etcd.data_dir)
