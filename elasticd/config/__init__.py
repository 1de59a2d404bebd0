"""The agent's configuration: typed, validated, loaded once.

Why: every setting the agent acts on is read, type-checked and
cross-checked here *before anything starts*, so a typo in a 64-node job fails on the
first node in under a second with one message that names the key, the value and
the fix, instead of hours later on the first restart. This package is also the only code
that looks at the environment; callers pass ``os.environ`` in.

Precedence (later wins): built-in defaults < TOML file < ``ELASTICD_*`` environment
< ``overrides`` (the CLI's flags, ``elasticd.config.flags``; torchrun's ``--rdzv-conf``,
``elasticd.rendezvous.registry``). Every way in goes through :func:`load_config`.

TOML layout (every key is documented with its default in docs/configuration.md)::

    [job]        name, nnodes, checkpoint_url, standalone, resume
    [checkpoint] every
    [etcd]       endpoints, ca_file, cert_file, key_file, user, password,
                 password_file, timeout_s, connect_timeout_s, election_timeout_s,
                 data_dir, insecure_allow_plaintext_auth
    [node]       id, local_addr, ttl_s
    [rendezvous] join_timeout_s, last_call_timeout_s, start_settle_s, close_timeout_s,
                 store_timeout_s, liveness_probe, valid_sizes, global_batch_size,
                 hang_eject_s, straggler_factor, straggler_window_s,
                 straggler_probation_s
    [workers]    command, nproc_per_node, workdir, monitor_interval_s,
                 hang_timeout_s, warm_start, standby_refill, spare_prebuild,
                 live_reform, live_reform_timeout_s, user, and a [workers.env] table
    [restart]    max_restarts, backoff_s, backoff_max_s
    [drain]      grace_s, resize_grace_s, plain_stop_s, done_exit_s
    [preemption] provider, base_url, poll_interval_s, drain_lead_s
    [logging]    format, level, worker_log_dir
    [metrics]    port, addr

Environment: ``ELASTICD_<SECTION>_<KEY>`` in upper case, e.g. ``ELASTICD_JOB_NAME``,
``ELASTICD_ETCD_ENDPOINTS``, ``ELASTICD_NODE_TTL_S``. Values are text and are
converted like flags (``"h1:2379,h2:2379"`` for lists, shell words for
``workers.command``, ``true``/``false`` for booleans). An empty value counts as unset.
Variables whose section part is not a section above (``ELASTICD_SOAK``,
``ELASTICD_CONFIG``) are ignored; a misspelt key inside a known section is an error.
``workers.env`` cannot come from the environment (workers inherit the agent's
environment anyway, so export the variable itself).

Override keys (the ``overrides`` mapping, one per CLI flag) are the dotted names::

    job.name  job.nnodes  job.checkpoint_url  job.standalone  job.resume
    checkpoint.every
    etcd.endpoints  etcd.ca_file  etcd.cert_file  etcd.key_file  etcd.user
    etcd.password  etcd.password_file  etcd.timeout_s  etcd.connect_timeout_s
    etcd.election_timeout_s  etcd.data_dir  etcd.insecure_allow_plaintext_auth
    node.id  node.local_addr  node.ttl_s
    rendezvous.join_timeout_s  rendezvous.last_call_timeout_s  rendezvous.liveness_probe
    rendezvous.start_settle_s  rendezvous.hang_eject_s  rendezvous.straggler_factor
    rendezvous.straggler_window_s  rendezvous.straggler_probation_s
    rendezvous.close_timeout_s  rendezvous.store_timeout_s
    rendezvous.valid_sizes  rendezvous.global_batch_size
    workers.command  workers.nproc_per_node  workers.workdir  workers.env
    workers.monitor_interval_s  workers.hang_timeout_s  workers.warm_start  workers.standby_refill
    workers.spare_prebuild      workers.live_reform  workers.live_reform_timeout_s  workers.user
    restart.max_restarts  restart.backoff_s  restart.backoff_max_s
    drain.grace_s  drain.resize_grace_s  drain.plain_stop_s  drain.done_exit_s
    preemption.provider  preemption.base_url  preemption.poll_interval_s  preemption.drain_lead_s
    logging.format  logging.level  logging.worker_log_dir
    metrics.port  metrics.addr

An override value of ``None`` means "flag not given" and is skipped, so argparse
results can be passed straight through. Values may be typed (``int``, ``list``) or
text (converted as for the environment). ``workers.env`` overrides are a mapping
merged variable by variable over the file's table.
"""

from elasticd.config.checks import availability_warnings, security_warnings, validate_config
from elasticd.config.loader import ENV_PREFIX, RESERVED_WORKER_ENV, load_config, render_effective
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

__all__ = [
    "ENV_PREFIX",
    "MASK",
    "RESERVED_WORKER_ENV",
    "AgentConfig",
    "CheckpointConfig",
    "DrainConfig",
    "EtcdConfig",
    "JobConfig",
    "LoggingConfig",
    "MetricsConfig",
    "NodeConfig",
    "PreemptionConfig",
    "RendezvousConfig",
    "RestartConfig",
    "WorkersConfig",
    "availability_warnings",
    "load_config",
    "render_effective",
    "security_warnings",
    "validate_config",
]
