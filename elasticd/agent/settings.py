"""From the validated configuration to the runtime: one function, every key.

Why one function: ``elasticd run``, ``elasticd agent`` and their tests all go through
:func:`node_spec`, and ``tests/unit/test_config_reaches_runtime.py`` walks every schema
key through it, so a key that is validated but never used (as ``logging.level``,
``metrics.addr`` and ``etcd.data_dir`` once were) cannot exist.
"""

from __future__ import annotations

from collections.abc import Mapping

from elasticd.agent.elastic_agent import SupervisionSettings
from elasticd.agent.preemption import make_watcher
from elasticd.agent.runner import NodeSpec
from elasticd.config import AgentConfig
from elasticd.etcd.client import TLSFiles
from elasticd.logs import default_state_root


def node_spec(cfg: AgentConfig, environ: Mapping[str, str]) -> NodeSpec:
    """Translate a validated :class:`AgentConfig` into the runner's :class:`NodeSpec`.

    Args:
        cfg: from :func:`elasticd.config.load_config`.
        environ: the agent's environment, for systemd's ``NOTIFY_SOCKET``,
            ``WATCHDOG_USEC`` and ``STATE_DIRECTORY`` (set by systemd, not by the operator).

    Returns:
        The spec :func:`elasticd.agent.runner.run_node` runs.
    """
    e, w, r = cfg.etcd, cfg.workers, cfg.rendezvous
    return NodeSpec(
        job=cfg.job.name, command=tuple(w.command), nproc_per_node=w.resolve_nproc_per_node(),
        min_nodes=cfg.job.min_nodes, max_nodes=cfg.job.max_nodes,
        etcd_endpoints=",".join(e.endpoints) or None, etcd_timeout_s=e.timeout_s,
        etcd_connect_timeout_s=e.connect_timeout_s, etcd_data_dir=e.data_dir,
        etcd_election_timeout_s=e.election_timeout_s,
        tls=TLSFiles(e.ca_file, e.cert_file, e.key_file), etcd_user=e.user,
        etcd_password=e.resolved_password(),
        etcd_insecure_plaintext_auth=e.insecure_allow_plaintext_auth, node_id=cfg.node.id, local_addr=cfg.node.local_addr,
        node_ttl_s=cfg.node.ttl_s, join_timeout_s=r.join_timeout_s,
        last_call_timeout_s=r.last_call_timeout_s, start_settle_s=r.start_settle_s,
        close_timeout_s=r.close_timeout_s,
        store_timeout_s=r.store_timeout_s, liveness_probe=r.liveness_probe,
        supervision=SupervisionSettings(
            max_restarts=cfg.restart.max_restarts, restart_backoff_s=cfg.restart.backoff_s,
            restart_backoff_max_s=cfg.restart.backoff_max_s, drain_grace_s=cfg.drain.grace_s,
            resize_grace_s=cfg.drain.resize_grace_s, plain_stop_s=cfg.drain.plain_stop_s,
            done_exit_s=cfg.drain.done_exit_s,
            hang_timeout_s=w.hang_timeout_s, attribution_window_s=cfg.node.ttl_s + 1.0,
            monitor_interval_s=w.monitor_interval_s, checkpoint_url=cfg.job.checkpoint_url,
            worker_env=dict(w.env), warm_start=w.warm_start,
            live_reform=w.live_reform, live_reform_timeout_s=w.live_reform_timeout_s),
        workdir=w.workdir, log_format=cfg.logging.format, log_level=cfg.logging.level,
        log_dir=cfg.logging.worker_log_dir,
        metrics_port=cfg.metrics.port or None, metrics_addr=cfg.metrics.addr,
        preemption=make_watcher(cfg.preemption.provider, base_url=cfg.preemption.base_url,
                                poll_interval_s=cfg.preemption.poll_interval_s,
                                drain_lead_s=cfg.preemption.drain_lead_s),
        notify_socket=environ.get("NOTIFY_SOCKET"), watchdog_usec=environ.get("WATCHDOG_USEC"),
        state_dir=environ.get("STATE_DIRECTORY"), resume=cfg.job.resume,
        state_home=default_state_root(environ.get("XDG_STATE_HOME"), environ.get("HOME")),
    )
