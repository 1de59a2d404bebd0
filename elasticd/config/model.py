"""The typed agent configuration: frozen dataclasses, one per TOML section.

Built and validated by :func:`elasticd.config.load_config`; code that uses the
configuration only reads these objects (they are immutable, so a config seen by one
thread is the config seen by all).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from elasticd.errors import ConfigError
from elasticd.sensitive import MASK, mask_value, read_secret_file, redact_url

# preemption.drain_lead_s when unset (PreemptionConfig.lead_s): a live drain writes no
# checkpoint; the restart path's does (docs/spot-instances.md, "When the drain starts").
LIVE_DRAIN_LEAD_S = 20.0
RESTART_DRAIN_LEAD_S = 60.0


@dataclass(frozen=True)
class JobConfig:
    """``[job]``: what is trained and by how many nodes."""

    name: str
    min_nodes: int = 1
    max_nodes: int = 1
    checkpoint_url: str | None = None
    standalone: bool = False
    # Checkpoints of another run under the same URL and job: "auto" refuses to start,
    # "require" resumes the newest of them, "never" ignores them (docs/checkpoints.md).
    resume: str = "auto"


@dataclass(frozen=True)
class CheckpointConfig:
    """``[checkpoint]``: how often workers on ``ElasticLoop`` save (docs/checkpoints.md)."""

    # "auto": Young–Daly over the measured save cost and the job's loss rate, <= 1 %
    # overhead (elasticd.checkpoint.cadence); a number: every that many steps; None: the
    # script's own ElasticLoop(save_every=...).
    every: int | str | None = None


@dataclass(frozen=True)
class EtcdConfig:
    """``[etcd]``: the control plane. No endpoints means an embedded private etcd."""

    endpoints: tuple[str, ...] = ()
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # never in logs
    password_file: str | None = None
    timeout_s: float = 3.0
    connect_timeout_s: float = 30.0
    # The members' --election-timeout (etcd's default 1 s): node.ttl_s must be >= 3x it.
    election_timeout_s: float = 1.0
    data_dir: str | None = None
    # Send user/password without TLS. Loudly named on purpose: only for a trusted network.
    insecure_allow_plaintext_auth: bool = False

    @property
    def embedded(self) -> bool:
        """True when the agent must start its own etcd (no endpoints configured)."""
        return not self.endpoints

    @property
    def tls(self) -> bool:
        """True when connections to etcd use TLS (a CA file, or ``https://`` endpoints)."""
        return self.ca_file is not None or any(e.startswith("https://") for e in self.endpoints)

    def host_ports(self) -> tuple[tuple[str, int], ...]:
        """Return the endpoints as ``(host, port)`` pairs (IPv6 hosts without brackets)."""
        out = []
        for endpoint in self.endpoints:
            host, _, port = endpoint.removeprefix("https://").rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return tuple(out)

    def resolved_password(self) -> str | None:
        """Return the etcd password, reading ``password_file`` if that is how it is given.

        Returns:
            The password with trailing CR/LF removed (elasticd.sensitive.read_secret_file),
            or None without auth.

        Raises:
            ConfigError: the password file cannot be read or is empty.
        """
        if self.password_file is None:
            return self.password
        return read_secret_file(self.password_file, "etcd.password_file")


@dataclass(frozen=True)
class NodeConfig:
    """``[node]``: this node's identity and liveness lease."""

    id: str
    local_addr: str | None = None
    ttl_s: int = 5


@dataclass(frozen=True)
class RendezvousConfig:
    """``[rendezvous]``: how rounds form."""

    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 1.0
    start_settle_s: float = 1.0  # the first round stays open this long once min joined
    close_timeout_s: float = 30.0
    store_timeout_s: float = 300.0
    liveness_probe: bool = True  # a refused TCP probe proves a straggler's agent gone
    # Node counts a round may form at (rendezvous.sizes); None: every size in job.nnodes.
    valid_sizes: tuple[int, ...] | None = None
    # > 0: valid sizes are those whose workers split this global batch evenly.
    global_batch_size: int = 0
    # The shortest stall after which the coordinator ejects a hung member (0: never):
    # rendezvous/hangs.py, docs/failure-model.md "Hung node".
    hang_eject_s: float = 2.0
    # A member whose own step time stays this many times the median's over the window is
    # flagged a straggler (0: never): rendezvous/stragglers.py, docs/failure-model.md.
    straggler_factor: float = 1.25
    straggler_window_s: float = 30.0
    # Eject a flagged straggler when the job is faster without it, and keep it a spare this
    # long before it is admitted again (0: flag only); live re-formation only.
    straggler_probation_s: float = 60.0


@dataclass(frozen=True)
class WorkersConfig:
    """``[workers]``: the training processes this node runs."""

    command: tuple[str, ...] = ()
    nproc_per_node: int | str = 1
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    monitor_interval_s: float = 0.1
    hang_timeout_s: float = 0.0
    warm_start: bool = True
    # Start new standbys once the workers train, for the next restart (False: only the
    # node's first workers come from standbys; no idle torch process per local rank).
    standby_refill: bool = True
    # A hot spare's workers run the script ahead of admission: imports done, model built
    # (docs/worker-api.md, "Hot spares build their model ahead").
    spare_prebuild: bool = False
    live_reform: bool = True
    live_reform_timeout_s: float = 30.0
    # Run every worker under this user's uid, gid and groups (the agent runs as root):
    # docs/security.md#workers-under-their-own-uid.
    user: str | None = None

    def resolve_nproc_per_node(self, device_count: Callable[[], int] | None = None) -> int:
        """Return the number of workers to start on this node.

        ``"gpu"`` means one per visible GPU (an error without GPUs); ``"auto"`` means one
        per visible GPU, or one on a machine without GPUs. torch is imported only here,
        so loading a config stays fast.

        Args:
            device_count: returns the number of visible GPUs; defaults to
                ``torch.cuda.device_count``.

        Raises:
            ConfigError: ``"gpu"`` was asked for and no GPU is visible.
        """
        if isinstance(self.nproc_per_node, int):
            return self.nproc_per_node
        if device_count is None:
            import torch

            device_count = torch.cuda.device_count
        count = int(device_count())
        if count > 0:
            return count
        if self.nproc_per_node == "auto":
            return 1
        raise ConfigError(
            'workers.nproc_per_node = "gpu": torch sees no GPU (torch.cuda.device_count() '
            "is 0); set nproc_per_node to a number of workers, or check the NVIDIA driver, "
            "a CUDA build of torch and CUDA_VISIBLE_DEVICES"
        )


@dataclass(frozen=True)
class RestartConfig:
    """``[restart]``: the worker-failure budget. Membership changes never consume it."""

    max_restarts: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0


@dataclass(frozen=True)
class DrainConfig:
    """``[drain]``: graceful stop (SIGTERM, preemption notice) and drain-on-join."""

    grace_s: float = 60.0
    # A node joining mid-training: workers get this long to stop at a step boundary
    # before they are restarted hard; 0 restarts them at once (no drain on a join).
    resize_grace_s: float = 30.0
    # A stop when the workers never called should_stop (plain scripts): their own SIGTERM
    # handler gets this long, then SIGKILL; the node leaves at once instead of after grace_s.
    plain_stop_s: float = 3.0
    # Workers whose script returned (exit 0) but that are still running this much later
    # (stuck in torch's teardown) are stopped and counted done.
    done_exit_s: float = 30.0


@dataclass(frozen=True)
class PreemptionConfig:
    """``[preemption]``: cloud spot/preemption notice watcher."""

    provider: str = "none"
    base_url: str | None = None
    poll_interval_s: float = 2.0
    # The drain starts when this many seconds are left before the notice's deadline.
    # Unset: LIVE_DRAIN_LEAD_S under live re-formation, else RESTART_DRAIN_LEAD_S.
    drain_lead_s: float | None = None

    def lead_s(self, live_reform: bool) -> float:
        """The drain lead this agent uses: the configured one, else the default for its path.

        Under live re-formation a drained node writes no checkpoint (the survivors keep the
        state; an FSDP node's ranks refresh their peer-RAM replica), so its drain needs the
        poll delay, one step and the leave; and a drain the deadline cuts off is a lost node,
        which costs the survivors no steps. The restart path saves at the drain.
        """
        if self.drain_lead_s is not None:
            return self.drain_lead_s
        return LIVE_DRAIN_LEAD_S if live_reform else RESTART_DRAIN_LEAD_S


@dataclass(frozen=True)
class LoggingConfig:
    """``[logging]``: structlog output."""

    format: str = "auto"
    level: str = "info"
    worker_log_dir: str | None = None


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: Prometheus exporter; port 0 turns it off."""

    port: int = 0
    # Loopback unless configured: the metrics name nodes and jobs; expose them on purpose.
    addr: str = "127.0.0.1"

    @property
    def enabled(self) -> bool:
        """True when the exporter should listen."""
        return self.port != 0


@dataclass(frozen=True)
class AgentConfig:
    """The whole, validated agent configuration. Build it with :func:`load_config`."""

    job: JobConfig
    etcd: EtcdConfig
    node: NodeConfig
    workers: WorkersConfig
    rendezvous: RendezvousConfig = RendezvousConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    restart: RestartConfig = RestartConfig()
    drain: DrainConfig = DrainConfig()
    preemption: PreemptionConfig = PreemptionConfig()
    logging: LoggingConfig = LoggingConfig()
    metrics: MetricsConfig = MetricsConfig()
    # Where each dotted key's value came from: "default", "file", "env ELASTICD_...",
    # "override". Shown by --check-config; not part of equality.
    origins: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, repr=False
    )
    path: str | None = field(default=None, compare=False)

    def masked(self) -> AgentConfig:
        """Return a copy safe to print: passwords, URL credentials (checkpoint URL, metadata
        base URL) and secret-looking ``workers.env`` values replaced by ``***``."""
        etcd = replace(self.etcd, password=MASK if self.etcd.password else None)
        url = self.job.checkpoint_url
        job = replace(self.job, checkpoint_url=redact_url(url) if url else url)
        env = {k: mask_value(k, v) for k, v in self.workers.env.items()}
        workers = replace(self.workers, env=MappingProxyType(env))
        base = self.preemption.base_url  # a metadata proxy's URL may carry a password
        preemption = replace(self.preemption, base_url=redact_url(base) if base else base)
        return replace(self, etcd=etcd, job=job, workers=workers, preemption=preemption)
