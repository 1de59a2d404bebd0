"""``elasticd agent``: the node daemon, driven by a TOML config (systemd's ExecStart).

Precedence: TOML < ``ELASTICD_*`` environment < flags. ``--check-config`` validates and
prints the effective configuration (secrets masked) without starting anything.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from elasticd.config import AgentConfig, load_config, render_effective

if TYPE_CHECKING:  # torch is imported only when the agent really runs (fast `elasticd status`)
    from elasticd.agent.runner import NodeSpec


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("agent", help="run the node agent from a config file (systemd)",
                       description="Run the elasticd node agent. Keys: docs/configuration.md.")
    p.add_argument("--config", "-c", help="TOML config file (e.g. /etc/elasticd/elasticd.toml)")
    p.add_argument("--check-config", action="store_true",
                   help="validate, print the effective config (secrets masked) and exit")
    p.add_argument("--job", dest="job.name", help="job name")
    p.add_argument("--etcd", dest="etcd.endpoints", help="etcd endpoints HOST:PORT[,...]")
    p.add_argument("--nnodes", dest="job.nnodes", help="N or MIN:MAX")
    p.add_argument("--nproc-per-node", dest="workers.nproc_per_node", help="N, 'gpu' or 'auto'")
    p.add_argument("--node-id", dest="node.id")
    p.add_argument("--local-addr", dest="node.local_addr")
    p.add_argument("--checkpoint-url", dest="job.checkpoint_url")
    p.add_argument("--max-restarts", dest="restart.max_restarts")
    p.add_argument("--drain-grace", dest="drain.grace_s")
    p.add_argument("--resize-grace", dest="drain.resize_grace_s")
    p.add_argument("--plain-stop", dest="drain.plain_stop_s")
    p.add_argument("--hang-timeout", dest="workers.hang_timeout_s")
    p.add_argument("--no-warm-start", dest="workers.warm_start", action="store_const", const="false",
                   help="start every worker cold (no standby processes)")
    p.add_argument("--log-format", dest="logging.format", choices=["auto", "json", "console"])
    p.add_argument("--metrics-port", dest="metrics.port")
    p.set_defaults(func=run)
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if "." in k and v is not None}


def node_spec(cfg: AgentConfig) -> NodeSpec:
    """Translate a validated ``AgentConfig`` into the runner's ``NodeSpec``."""
    from elasticd.agent.elastic_agent import SupervisionSettings
    from elasticd.agent.preemption import make_watcher
    from elasticd.agent.runner import NodeSpec
    from elasticd.etcd.client import TLSFiles

    e, w = cfg.etcd, cfg.workers
    return NodeSpec(
        job=cfg.job.name, command=tuple(w.command), nproc_per_node=w.resolve_nproc_per_node(),
        min_nodes=cfg.job.min_nodes, max_nodes=cfg.job.max_nodes,
        etcd_endpoints=",".join(e.endpoints) or None, etcd_timeout_s=e.timeout_s,
        etcd_connect_timeout_s=e.connect_timeout_s,
        tls=TLSFiles(e.ca_file, e.cert_file, e.key_file), etcd_user=e.user,
        etcd_password=e.resolved_password(), node_id=cfg.node.id, local_addr=cfg.node.local_addr,
        node_ttl_s=cfg.node.ttl_s, join_timeout_s=cfg.rendezvous.join_timeout_s,
        last_call_timeout_s=cfg.rendezvous.last_call_timeout_s,
        supervision=SupervisionSettings(
            max_restarts=cfg.restart.max_restarts, restart_backoff_s=cfg.restart.backoff_s,
            restart_backoff_max_s=cfg.restart.backoff_max_s, drain_grace_s=cfg.drain.grace_s,
            resize_grace_s=cfg.drain.resize_grace_s, plain_stop_s=cfg.drain.plain_stop_s,
            done_exit_s=cfg.drain.done_exit_s,
            hang_timeout_s=w.hang_timeout_s, attribution_window_s=cfg.node.ttl_s + 1.0,
            monitor_interval_s=w.monitor_interval_s, checkpoint_url=cfg.job.checkpoint_url,
            worker_env=dict(w.env), warm_start=w.warm_start),
        workdir=w.workdir, log_format=cfg.logging.format, log_dir=cfg.logging.worker_log_dir,
        metrics_port=cfg.metrics.port or None,
        preemption=make_watcher(cfg.preemption.provider, base_url=cfg.preemption.base_url,
                                poll_interval_s=cfg.preemption.poll_interval_s),
        notify_socket=os.environ.get("NOTIFY_SOCKET"), watchdog_usec=os.environ.get("WATCHDOG_USEC"),
    )


def run(args: argparse.Namespace) -> int:
    path = args.config or os.environ.get("ELASTICD_CONFIG")
    cfg = load_config(path, os.environ, _overrides(args))
    if args.check_config:
        sys.stdout.write(render_effective(cfg))
        return 0
    from elasticd.agent.runner import run_node

    return run_node(node_spec(cfg))
