"""From the validated configuration to the runtime: one function, every key.

Why one function: ``elasticd run``, ``elasticd agent`` and their tests all go through
:func:`node_spec`, and ``tests/unit/test_config_reaches_runtime.py`` walks every schema
key through it, so a key that is validated but never used (as ``logging.level``,
``metrics.addr`` and ``etcd.data_dir`` once were) cannot exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from elasticd.agent.elastic_agent import SupervisionSettings
from elasticd.agent.preemption import make_watcher
from elasticd.agent.runner import NodeSpec
from elasticd.config import AgentConfig
from elasticd.logs import default_state_root
from elasticd.rendezvous.settings import RendezvousSettings


def node_spec(cfg: AgentConfig, environ: Mapping[str, str]) -> NodeSpec:
    """Translate a validated :class:`AgentConfig` into the runner's :class:`NodeSpec`.

    Args:
        cfg: from :func:`elasticd.config.load_config`.
        environ: the agent's environment, for systemd's ``NOTIFY_SOCKET``,
            ``WATCHDOG_USEC`` and ``STATE_DIRECTORY`` (set by systemd, not by the operator).

    Returns:
        The spec :func:`elasticd.agent.runner.run_node` runs.
    """
    e, w = cfg.etcd, cfg.workers
    nproc = w.resolve_nproc_per_node()
    return NodeSpec(
        job=cfg.job.name, command=tuple(w.command), nproc_per_node=nproc,
        rendezvous=RendezvousSettings.from_config(cfg, nproc),
        # The password file is read now: an unreadable one fails before anything starts.
        etcd=replace(e, password=e.resolved_password(), password_file=None),
        node_id=cfg.node.id,
        supervision=SupervisionSettings(
            max_restarts=cfg.restart.max_restarts, restart_backoff_s=cfg.restart.backoff_s,
            restart_backoff_max_s=cfg.restart.backoff_max_s, drain_grace_s=cfg.drain.grace_s,
            resize_grace_s=cfg.drain.resize_grace_s, plain_stop_s=cfg.drain.plain_stop_s,
            done_exit_s=cfg.drain.done_exit_s,
            hang_timeout_s=w.hang_timeout_s, attribution_window_s=cfg.node.ttl_s + 1.0,
            monitor_interval_s=w.monitor_interval_s, checkpoint_url=cfg.job.checkpoint_url,
            checkpoint_every=str(cfg.checkpoint.every or ""),
            worker_env=dict(w.env), warm_start=w.warm_start,
            standby_refill=w.standby_refill, spare_prebuild=w.spare_prebuild,
            live_reform=w.live_reform, live_reform_timeout_s=w.live_reform_timeout_s,
            workers_user=w.user),
        workdir=w.workdir, log_format=cfg.logging.format, log_level=cfg.logging.level,
        log_dir=cfg.logging.worker_log_dir,
        metrics_port=cfg.metrics.port or None, metrics_addr=cfg.metrics.addr,
        preemption=make_watcher(cfg.preemption.provider, base_url=cfg.preemption.base_url,
                                poll_interval_s=cfg.preemption.poll_interval_s,
                                drain_lead_s=cfg.preemption.lead_s(w.live_reform)),
        notify_socket=environ.get("NOTIFY_SOCKET"), watchdog_usec=environ.get("WATCHDOG_USEC"),
        state_dir=environ.get("STATE_DIRECTORY"), resume=cfg.job.resume,
        state_home=default_state_root(environ.get("XDG_STATE_HOME"), environ.get("HOME")),
    )
