"""The agent's boot sequence: the checks a node passes before it joins its job, defined once.

One ordered list of named checks (:data:`SEQUENCE`), one executor (:func:`run_checks`) and
one typed outcome (:class:`BootOutcome`). The sequence runs before torch is imported
(:func:`boot_before_import`, from ``elasticd.agent.early``) when it can, and after the
import the runner and the rendezvous handler run only what that did not do or what can
have changed during the ~2 s import (:func:`checks_after_import`, a pure plan). Where each
check runs, and why once or twice:

1. ``STOP`` (``elasticd stop`` / ``drain`` marks, elasticd.stopmarks): before the import,
   one read (a stopped job exits 0 in a fraction of a second, its standby dies); after it,
   **always again**, by the runner, with retries (:func:`boot_after_import`): a stop
   written during the import must still be an exit 0 before joining.
2. ``FINISHED`` (``rdzv/closed``, elasticd.rendezvous.finished): before the import, one
   read; after it, **always again**, by the rendezvous handler's first rendezvous
   (``EtcdRendezvousHandler._refuse_finished_job``, from its watched view: no extra read
   unless closed): the job's last members can close it during the import.
3. ``PRECHECK`` (admission, two reads, nothing written): before the import; after it only
   when the early path did not admit this node (the runner).
4. ``REGISTER`` (lease and node record, ``NodeSession.register``; a node id a live agent
   holds is refused here): before the import; after it only when the early path did not
   (the handler, which otherwise adopts the early session).
5. ``ADMIT`` (admission's transaction, elasticd.agent.admission): before the import;
   after it only when the early path did not (the handler's ``on_registered``). An
   admission the transaction decided is never checked again: it binds while our record
   lives.
6. ``EARLY_JOIN`` (join the job's first round while it is open,
   ``protocol.early_join_round``): before the import only; the handler joins the usual
   way otherwise.

The early path is skipped (:attr:`BootVerdict.DEFERRED`, and the runner and handler run
every check, with retries and proper error reports) when the embedded etcd is not running
yet (``etcd.embedded``: a standalone job has one node; a fresh private etcd holds no stop
mark and no close, so a finished standalone run starting anew is the run record's
business, ``plan_standalone_run`` in the runner, not this sequence's), when the world
sizes derive from the global batch and the worker count needs torch, and when anything
fails (etcd slow or unreachable within :data:`_DEADLINE_S`, an id held elsewhere whose
lease the deadline cut short). Two refusals are certain and end the agent before the
import (exit 78): a foreign program (``PRECHECK``/``ADMIT``) and a node id a live agent
holds (``REGISTER``).

Why register before the import (the start race, issue 25 item 2): the coordinator closes
the job's first round once every node that *holds a lease* joined. Registered only inside
its first ``next_rendezvous``, after its torch import, two nodes started 0.03-0.35 s
apart formed two rounds and a short script ran twice. Registered here, 0.1-0.3 s after the
agent started, a node started with the others holds the first round until it joins.

This module must not import torch: ``elasticd.rendezvous.session`` and
``elasticd.rendezvous.finished`` do not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
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
from elasticd.agent.remote_control import refusal_at_start
from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys
from elasticd.records import JobFingerprint, RecordError, RoundState
from elasticd.rendezvous.finished import FinishedJob, finished_notice, read_finished
from elasticd.rendezvous.protocol import early_join_round
from elasticd.rendezvous.session import DuplicateNodeIdError, NodeSession
from elasticd.rendezvous.settings import RendezvousSettings, default_node_id
from elasticd.rendezvous.view import WatchedView
from elasticd.stopmarks import StopRequest, read_request, restart_hint

if TYPE_CHECKING:
    from elasticd.config.model import AgentConfig, EtcdConfig

log = structlog.get_logger(__name__)

_DEADLINE_S = 5.0  # best effort: never hold the agent's start longer than this


class BootCheck(Enum):
    """One check of the boot sequence (the module docstring says where each runs)."""

    STOP = "stop"
    FINISHED = "finished"
    PRECHECK = "precheck"
    REGISTER = "register"
    ADMIT = "admit"
    EARLY_JOIN = "early_join"


# The order: a stopped or finished job is answered before anything is read of the
# job's program, and nothing is written before the admission precheck.
SEQUENCE: tuple[BootCheck, ...] = (BootCheck.STOP, BootCheck.FINISHED, BootCheck.PRECHECK,
                                   BootCheck.REGISTER, BootCheck.ADMIT, BootCheck.EARLY_JOIN)
# Written by others (the operator, the job's last members): may appear during the import.
RECHECKED_AFTER_IMPORT = frozenset({BootCheck.STOP, BootCheck.FINISHED})
# Only worth it before the import; the handler joins the usual way.
BEFORE_IMPORT_ONLY = frozenset({BootCheck.EARLY_JOIN})
# After the import, run by the rendezvous handler's first rendezvous (``arrive``).
BY_HANDLER = frozenset({BootCheck.FINISHED, BootCheck.REGISTER, BootCheck.ADMIT})


class BootVerdict(Enum):
    """What the sequence decided."""

    JOIN = "join"          # every check it ran passed: go on
    STOPPED = "stopped"    # the job is stopped or this node drained: exit 0
    FINISHED = "finished"  # the job finished: exit 0
    DEFERRED = "deferred"  # not run before the import: the runner and handler run it all


# A check: None to go on, a StopRequest or FinishedJob to end the sequence there; a
# refusal (exit 78) raises.
Step = Callable[[], StopRequest | FinishedJob | None]


@dataclass
class BootOutcome:
    """The sequence's outcome, and before the import what it holds.

    ``run_node`` takes ``client`` and ``session`` over (the handler adopts the session);
    ``close`` releases whatever was not taken over (idempotent).
    """

    verdict: BootVerdict
    done: frozenset[BootCheck] = frozenset()  # the checks that ran and passed
    refused: StopRequest | None = None  # STOPPED
    finished: FinishedJob | None = None  # FINISHED
    reason: str = ""  # DEFERRED: why
    client: EtcdClient | None = None
    session: NodeSession | None = None
    # Keeps the lease alive while torch is imported (elasticd.agent.lease_bridge), or None.
    bridge: LeaseBridge | None = None
    taken: bool = field(default=False)  # run_node owns the client and session now

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
        if self.client is not None:
            self.client.close()


def run_checks(steps: Mapping[BootCheck, Step], order: Sequence[BootCheck]) -> BootOutcome:
    """Run ``order``'s checks in turn until one ends the sequence.

    Args:
        steps: how each check is done here; every check of ``order`` must have one (a
            missing one is a bug, raised, never skipped).
        order: the checks to run, a subsequence of :data:`SEQUENCE`.

    Returns:
        STOPPED or FINISHED with what was found, else JOIN; ``done`` names the checks
        that passed.

    Raises:
        KeyError: a check of ``order`` has no step.
        AdmissionRefusedError, DuplicateNodeIdError, TransientError: from the steps.
    """
    done: list[BootCheck] = []
    for check in order:
        found = steps[check]()
        if isinstance(found, StopRequest):
            return BootOutcome(BootVerdict.STOPPED, frozenset(done), refused=found)
        if isinstance(found, FinishedJob):
            return BootOutcome(BootVerdict.FINISHED, frozenset(done), finished=found)
        done.append(check)
    return BootOutcome(BootVerdict.JOIN, frozenset(done))


@dataclass(frozen=True)
class AfterImport:
    """Which checks run after the torch import, and by whom (in sequence order)."""

    runner: tuple[BootCheck, ...]   # boot_after_import, before the handler joins
    handler: tuple[BootCheck, ...]  # the handler's first rendezvous

    @property
    def admit_on_register(self) -> bool:
        """The handler must admit this node once registered (``on_registered``)."""
        return BootCheck.ADMIT in self.handler


def checks_after_import(early: BootOutcome | None) -> AfterImport:
    """The checks left after the torch import: those the early path did not pass, and the
    re-checks of what others can write meanwhile (:data:`RECHECKED_AFTER_IMPORT`). Pure.

    Args:
        early: the outcome of :func:`boot_before_import` (JOIN or DEFERRED), or None.
    """
    done = early.done if early is not None and early.verdict is BootVerdict.JOIN else frozenset()
    left = [c for c in SEQUENCE if c not in BEFORE_IMPORT_ONLY
            and (c in RECHECKED_AFTER_IMPORT or c not in done)]
    return AfterImport(runner=tuple(c for c in left if c not in BY_HANDLER),
                       handler=tuple(c for c in left if c in BY_HANDLER))


def boot_after_import(client: EtcdClient, keys: JobKeys, node_id: str, ours: JobFingerprint,
                      plan: AfterImport, *, deadline_s: float) -> BootOutcome:
    """The runner's share of the sequence after the torch import (``plan.runner``), with
    retries; the handler's share runs in its first rendezvous.

    Raises:
        AdmissionRefusedError: a live agent of the job runs another program (exit 78).
        TransientError: etcd stayed unreachable for ``deadline_s``.
    """

    def prechecked() -> None:
        precheck(client, keys, node_id, ours, deadline_s=deadline_s)

    return run_checks({
        BootCheck.STOP: lambda: refusal_at_start(client, keys, node_id, deadline_s=deadline_s),
        BootCheck.PRECHECK: prechecked,
    }, plan.runner)


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


def log_refused(req: StopRequest, node_id: str | None) -> None:
    """The one line of an agent that arrives at a stopped job or as a drained node (it
    then exits 0)."""
    log.warning("agent_not_joining", job=req.job, node=node_id, reason=req.reason,
                fix=restart_hint(req))


class _NeedsTorch(Exception):
    """The early path cannot compute this node's fingerprint without torch."""


def boot_before_import(cfg: AgentConfig, *,
                       connect: Callable[[EtcdConfig], EtcdClient] = EtcdClient.from_config,
                       ) -> BootOutcome:
    """The whole sequence, before torch is imported: STOPPED, FINISHED, JOIN (this node
    registered, admitted, and in the first round if it was open: ``session``), or
    DEFERRED when there is nothing to gain or anything failed (the runner then runs every
    check, with retries).

    Args:
        cfg: the validated ``AgentConfig``.
        connect: makes the etcd client of ``cfg.etcd`` (a fake in unit tests).

    Raises:
        AdmissionRefusedError: a live agent of the job runs another program (exit 78).
        DuplicateNodeIdError: a live agent holds this node id (exit 78).
    """
    e = cfg.etcd
    if e.embedded:
        return BootOutcome(BootVerdict.DEFERRED, reason="the embedded etcd is not running yet")
    keys = JobKeys(cfg.job.name)
    try:
        client = connect(e)
    except Exception as exc:  # noqa: BLE001 - the runner reports configuration problems properly
        return BootOutcome(BootVerdict.DEFERRED, reason=f"no etcd client: {exc}")
    node_id = cfg.node.id or default_node_id()
    # A node without a configured id gets host-pid: only the job's stop can apply to it.
    marks_id = cfg.node.id or "-"
    session: NodeSession | None = None
    ours: JobFingerprint | None = None

    def prechecked() -> None:
        nonlocal ours
        if cfg.rendezvous.global_batch_size and not isinstance(cfg.workers.nproc_per_node, int):
            raise _NeedsTorch  # the sizes derive from the worker count, which needs torch
        ours = make_fingerprint(cfg.workers.command, min_nodes=cfg.job.min_nodes,
                                max_nodes=cfg.job.max_nodes,
                                checkpoint_url=cfg.job.checkpoint_url,
                                live_reform=cfg.workers.live_reform,
                                workdir=cfg.workers.workdir, node=node_id,
                                extra=sizes_fingerprint(
                                    RendezvousSettings.from_config(cfg).valid_sizes))
        precheck(client, keys, node_id, ours, deadline_s=_DEADLINE_S)

    def registered() -> None:
        nonlocal session
        assert ours is not None
        session = NodeSession(client, keys, node_id, WatchedView(keys, node_id),
                              ttl_s=cfg.node.ttl_s, liveness_probe=cfg.rendezvous.liveness_probe,
                              local_addr=cfg.node.local_addr, fingerprint=ours.digest)
        session.register(time.monotonic() + _DEADLINE_S)

    def admitted() -> None:
        assert ours is not None
        admit(client, keys, node_id, ours, deadline_s=_DEADLINE_S)

    def joined() -> None:
        assert session is not None
        session.early_join = _join_first_round(client, keys, session, cfg.job.min_nodes,
                                               cfg.job.max_nodes)

    try:
        outcome = run_checks({
            BootCheck.STOP: lambda: read_request(client, keys, marks_id),
            BootCheck.FINISHED: lambda: read_finished(client, keys),
            BootCheck.PRECHECK: prechecked,
            BootCheck.REGISTER: registered,
            BootCheck.ADMIT: admitted,
            BootCheck.EARLY_JOIN: joined,
        }, SEQUENCE)
    except (AdmissionRefusedError, DuplicateNodeIdError):
        if session is not None:
            session.close()  # revoke: our record goes at once (a duplicate wrote none)
        client.close()
        raise  # exit 78 (elasticd.cli), before torch is imported
    except _NeedsTorch:
        client.close()
        return BootOutcome(BootVerdict.DEFERRED,
                           reason="the world sizes derive from the global batch and the worker count")
    except Exception as exc:  # noqa: BLE001 - best effort: the runner checks and reports
        log.info("early_registration_skipped", error=str(exc))
        if session is not None:
            session.close()  # a lease granted before the failure
        client.close()
        return BootOutcome(BootVerdict.DEFERRED, reason=str(exc))
    outcome.client = client
    if outcome.verdict is not BootVerdict.JOIN:
        return outcome  # nothing registered: close() closes the client
    assert session is not None
    outcome.session = session
    outcome.bridge = LeaseBridge.start(e, session.lease_id)
    return outcome
