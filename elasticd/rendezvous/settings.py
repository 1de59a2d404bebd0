"""The rendezvous's settings: timing and size, shared by the handler, the agent and torchrun."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticd.rendezvous.sizes import resolve_valid_sizes

if TYPE_CHECKING:
    from elasticd.config.model import AgentConfig


@dataclass(frozen=True)
class RendezvousSettings:
    """Timing and size of the rendezvous (all durations in seconds)."""

    min_nodes: int
    max_nodes: int
    node_ttl_s: int = 5
    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 1.0
    # The job's first round stays open this long once min_nodes joined (min < max), so
    # nodes started together train together (protocol._close_open_round).
    start_settle_s: float = 1.0
    close_timeout_s: float = 30.0
    store_timeout_s: float = 300.0
    local_addr: str | None = None
    worker_log_dir: str | None = None  # published in the node record, for `elasticd status`
    election_timeout_s: float = 1.0  # the etcd members' --election-timeout (outage grace)
    # Hold a liveness listener and probe stragglers/peers (elasticd.rendezvous.liveness).
    liveness_probe: bool = True
    # The shortest stall after which the coordinator ejects a hung member (0: never).
    hang_eject_s: float = 2.0
    # Straggler detection (rendezvous/stragglers.py): the factor (0: off) and the window.
    straggler_factor: float = 1.25
    straggler_window_s: float = 30.0
    # Eject a flagged straggler when the shrink pays, on probation this long (0: never).
    straggler_probation_s: float = 60.0
    # The digest of this agent's job fingerprint, carried in its node record (admission).
    fingerprint: str = ""
    # The node counts a round may form at (rendezvous.sizes); empty: every size in min..max.
    valid_sizes: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: AgentConfig, nproc_per_node: int | None = None) -> RendezvousSettings:
        """The settings of a validated config: the one mapping, for the agent and torchrun.

        ``worker_log_dir`` is left unset: the agent resolves it at start (a private dir).
        ``nproc_per_node``: the resolved worker count (for sizes derived from the global
        batch); None: the configured number (1 for "gpu"/"auto").

        Raises:
            ConfigError: no valid world size (``rendezvous.sizes.resolve_valid_sizes``).
        """
        r = cfg.rendezvous
        nproc = cfg.workers.nproc_per_node
        if nproc_per_node is None:
            nproc_per_node = nproc if isinstance(nproc, int) else 1
        valid = resolve_valid_sizes(r.valid_sizes or (), r.global_batch_size, nproc_per_node,
                                    min_nodes=cfg.job.min_nodes, max_nodes=cfg.job.max_nodes)
        return cls(min_nodes=cfg.job.min_nodes, max_nodes=cfg.job.max_nodes,
                   node_ttl_s=cfg.node.ttl_s, join_timeout_s=r.join_timeout_s,
                   last_call_timeout_s=r.last_call_timeout_s, start_settle_s=r.start_settle_s,
                   close_timeout_s=r.close_timeout_s, store_timeout_s=r.store_timeout_s,
                   local_addr=cfg.node.local_addr,
                   election_timeout_s=cfg.etcd.election_timeout_s,
                   liveness_probe=r.liveness_probe, valid_sizes=valid,
                   hang_eject_s=r.hang_eject_s, straggler_factor=r.straggler_factor,
                   straggler_window_s=r.straggler_window_s,
                   # Safe only where a shrink loses no step: the live path (a restart
                   # would cost a checkpoint reload and the steps since).
                   straggler_probation_s=(r.straggler_probation_s
                                          if cfg.workers.live_reform else 0.0))


def default_node_id() -> str:
    """``<host>-<pid>``: unique per agent process on a machine, readable in ``status``."""
    host = socket.gethostname().split(".")[0] or "node"
    return f"{host}-{os.getpid()}"
