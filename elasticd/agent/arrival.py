"""Register the node before the agent imports torch (the start race, issue 25 item 2).

Why: the coordinator closes the job's first round once every node that *holds a lease*
joined (protocol._close_open_round). An agent registered only inside its first
``next_rendezvous``, after its ~2 s torch import (and, joining a formed round, after its
standbys' imports too): two nodes started 0.03-0.35 s apart then formed two rounds, and
a short script ran twice (alone, then again at world 2), or finished before the second
node arrived. Registered here, 0.1-0.3 s after the agent started, a node started together
with the others holds the first round's last call until it joins.

The boot checks run here as one sequence on one etcd client, before torch is imported:
is the job stopped or this node drained (``elasticd stop``/``drain``, elasticd.stopmarks),
has the job finished (elasticd.rendezvous.finished), is this node's program the job's
(admission), then register, admit, and join round 0. An agent that systemd restarts on a
stopped or finished job exits 0 in a fraction of a second. (The runner looks at the stop
marks and admission again after the import, with retries: a stop or a foreign agent that
arrived during those seconds.)

This module must not import torch: ``elasticd.rendezvous.session`` and
``elasticd.rendezvous.finished`` do not. Everything here is best effort: a failure
(etcd slow or unreachable, an id held elsewhere whose lease the deadline cut short)
returns None and the rendezvous handler registers the usual way, reporting the problem
properly. Two refusals are certain and end the agent here, before the torch import
(exit 78): a foreign program (admission) and a node id a live agent holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from elasticd.agent.admission import (
    AdmissionRefusedError,
    admit,
    make_fingerprint,
    precheck,
    sizes_fingerprint,
)
from elasticd.agent.lease_bridge import LeaseBridge
from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys
from elasticd.records import RecordError, RoundState
from elasticd.rendezvous.finished import FinishedJob, finished_notice, read_finished
from elasticd.rendezvous.protocol import early_join_round
from elasticd.rendezvous.session import DuplicateNodeIdError, NodeSession
from elasticd.rendezvous.settings import RendezvousSettings, default_node_id
from elasticd.rendezvous.view import WatchedView
from elasticd.stopmarks import StopRequest, read_request, restart_hint

if TYPE_CHECKING:
    from elasticd.config.model import AgentConfig

log = structlog.get_logger(__name__)

_DEADLINE_S = 5.0  # best effort: never hold the agent's start longer than this


@dataclass
class EarlyArrival:
    """A node registered before torch was imported, or a job found stopped or finished.

    ``run_node`` takes ``client`` and ``session`` over (the handler adopts the session);
    ``close`` releases whatever was not taken over (idempotent).
    """

    client: EtcdClient
    session: NodeSession | None
    finished: FinishedJob | None = None
    refused: StopRequest | None = None  # the job is stopped or this node drained
    taken: bool = False  # run_node owns the client and session now
    # Keeps the lease alive while torch is imported (elasticd.agent.lease_bridge), or None.
    bridge: LeaseBridge | None = None

    def hand_over(self) -> None:
        """The handler owns the session now (torch is imported: its keep-alives run)."""
        self.taken = True
        if self.bridge is not None:
            self.bridge.stop()

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.stop()
        if self.taken:
            return
        if self.session is not None:
            self.session.close()  # revoke: the node is gone at once, not after its TTL
        self.client.close()


def _join_first_round(client: EtcdClient, keys: JobKeys, session: NodeSession, min_nodes: int,
                      max_nodes: int) -> int | None:
    """Join the job's first round now, if it is open (``protocol.early_join_round``);
    open round 0 first if there is no round yet, as the handler would (INIT). Returns the
    round joined, or None (the handler joins the usual way)."""
    for _ in range(3):  # a lost compare-and-swap on round 0: read it again
        kv = client.get(keys.rdzv_state)
        try:
            state = RoundState.from_json(kv.value) if kv is not None else None
        except RecordError:
            return None
        r = early_join_round(state)
        if r is None:
            return None
        if state is None:
            fresh = RoundState(0, "open", [], min_nodes, max_nodes, opened_at=time.time())
            client.put_if(keys.rdzv_state, fresh.to_json(), mod_revision=0)
            continue
        client.put(keys.join(r, session.node_id), b"1", lease=session.lease_id)
        log.info("first_round_joined_early", round=r)
        return r
    return None


def log_finished(finished: FinishedJob, **extra: str) -> None:
    """The one line of an agent that arrives at a finished job (it then exits 0)."""
    reason, fix = finished_notice(finished)
    log.warning("agent_not_joining", job=finished.job, reason=reason, fix=fix, **extra)


def log_refused(cfg: AgentConfig, req: StopRequest) -> None:
    """The one line of an agent that arrives at a stopped job or as a drained node (it
    then exits 0)."""
    log.warning("agent_not_joining", job=req.job, node=cfg.node.id, reason=req.reason,
                fix=restart_hint(req))


def arrive_early(cfg: AgentConfig) -> EarlyArrival | None:
    """The boot checks and the registration, in one sequence before torch is imported:
    stopped or drained (``refused``), finished (``finished``), else admission, this
    node's lease and record, and its join of round 0. None when there is nothing to gain
    (the embedded etcd is not running yet: a standalone job has one node) or anything
    failed: the runner then checks and registers the usual way, with retries.

    Args:
        cfg: the validated ``AgentConfig``.

    Raises:
        AdmissionRefusedError: a live agent of the job runs another program (exit 78).
        DuplicateNodeIdError: a live agent holds this node id (exit 78).
    """
    e = cfg.etcd
    if e.embedded:
        return None
    keys = JobKeys(cfg.job.name)
    try:
        client = EtcdClient.from_config(e)
    except Exception:  # noqa: BLE001 - the runner reports configuration problems properly
        return None
    try:
        # A node without a configured id gets host-pid: only the job's stop can apply.
        refused = read_request(client, keys, cfg.node.id or "-")
        if refused is not None:
            return EarlyArrival(client, None, refused=refused)
        finished = read_finished(client, keys)
        if finished is not None:
            return EarlyArrival(client, None, finished)
        if cfg.rendezvous.global_batch_size and not isinstance(cfg.workers.nproc_per_node, int):
            # Sizes derived from the global batch need the resolved worker count (torch).
            client.close()
            return None
        node_id = cfg.node.id or default_node_id()
        # Admission before the first round is touched (elasticd.agent.admission): a
        # foreign program is refused here, before it registers, in the common case.
        ours = make_fingerprint(cfg.workers.command, min_nodes=cfg.job.min_nodes,
                                max_nodes=cfg.job.max_nodes,
                                checkpoint_url=cfg.job.checkpoint_url,
                                live_reform=cfg.workers.live_reform,
                                workdir=cfg.workers.workdir, node=node_id,
                                extra=sizes_fingerprint(
                                    RendezvousSettings.from_config(cfg).valid_sizes))
        precheck(client, keys, node_id, ours, deadline_s=_DEADLINE_S)
        session = NodeSession(client, keys, node_id, WatchedView(keys, node_id),
                              ttl_s=cfg.node.ttl_s, liveness_probe=cfg.rendezvous.liveness_probe,
                              local_addr=cfg.node.local_addr, fingerprint=ours.digest)
        deadline = time.monotonic() + _DEADLINE_S
        session.register(deadline)
        admit(client, keys, node_id, ours, deadline_s=_DEADLINE_S)
        session.early_join = _join_first_round(client, keys, session, cfg.job.min_nodes,
                                               cfg.job.max_nodes)
    except (AdmissionRefusedError, DuplicateNodeIdError):
        if "session" in locals():
            session.close()  # revoke: our record goes at once (a duplicate wrote none)
        client.close()
        raise  # exit 78 (elasticd.cli), before torch is imported
    except Exception as exc:  # noqa: BLE001 - best effort: the handler registers and reports
        log.info("early_registration_skipped", error=str(exc))
        if "session" in locals():
            session.close()  # a lease granted before the failure
        client.close()
        return None
    return EarlyArrival(client, session, bridge=LeaseBridge.start(e, session.lease_id))
