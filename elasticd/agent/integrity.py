"""Replica divergence on the agent's side: a rank of this node held state that differed from
its replicas' (``elasticd.worker.fingerprint``), and the job must be able to see it.

Why an event and not only a worker log line: an operator reads ``elasticd status`` and the
metrics, not eight workers' logs, and a node whose ranks diverge twice is a bad machine
(a flipped bit, a failing device), not bad luck. Each rank found diverged reports itself
over the control channel; this node then appends a ``diverged`` event naming the rank and
the node (the goodput ledger charges the interval to ``integrity``) and counts
``elasticd_replica_divergences_total``.

Quarantine: a node whose ranks diverge again within :data:`QUARANTINE_WINDOW_S` is put on
probation the way an ejected straggler is (``rdzv/probation/<node>`` on a lease, written by
the node's own agent, which alone sees its ranks' reports): its workers stop at the next
agreed step, the others re-form without it, it waits as a spare and is admitted again when
the lease ends (``rendezvous.straggler_probation_s``, doubled for each quarantine). Never
below the job's minimum: a node the job cannot spare keeps training (each divergence is
still restored, and still an event).

Policy (pure): :func:`divergence_message`, :func:`quarantine_s`. Mechanism:
:class:`DivergenceObserver`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import structlog

from elasticd.control.messages import DivergenceReport
from elasticd.errors import TransientError
from elasticd.etcd.txn import Put
from elasticd.records import ProbationRecord
from elasticd.rendezvous.stragglers import probation_s

if TYPE_CHECKING:
    from elasticd.agent.recorder import JobRecorder
    from elasticd.status.metrics import AgentMetrics

log = structlog.get_logger(__name__)

DIVERGED_EVENT = "diverged"
QUARANTINED_EVENT = "quarantined"
# A node whose ranks diverge twice within this long is a bad machine, not bad luck.
QUARANTINE_WINDOW_S = 3600.0
PROBATION_CAUSE = "diverged"  # ProbationRecord.cause of a quarantine


def quarantine_s(divergences: Sequence[float], now: float, *, base_s: float, earlier: int,
                 can_leave: bool, window_s: float = QUARANTINE_WINDOW_S) -> float:
    """How long to quarantine this node now, from the times its ranks diverged; 0: not.

    Args:
        divergences: the wall-clock times of this node's divergence events (one per check
            that named one of its ranks), the newest included.
        base_s: the probation of a first quarantine (``straggler_probation_s``; 0: never).
        earlier: how often this node was quarantined before (each doubles the probation).
        can_leave: the job stays at or above its minimum without this node.
    """
    recent = [t for t in divergences if now - window_s <= t <= now]
    if base_s <= 0 or len(recent) < 2 or not can_leave:
        return 0.0
    return probation_s(base_s, earlier + 1)


def divergence_message(report: DivergenceReport) -> str:
    """The event's one-line account: which rank, at which step, and what was done about it."""
    head = f"rank {report.rank} diverged from its replicas at step {report.step}"
    if report.source >= 0:
        return f"{head}: restored in memory from rank {report.source}"
    return f"{head}: no majority to restore from, restarting from the newest checkpoint"


class DivergenceObserver:
    """The control channel's handler of the workers' divergence reports.

    Args:
        recorder: appends the job's events (this node's name is the event's node) and
            holds the etcd client and keys the quarantine is written with.
        metrics: this agent's metrics; None without a metrics port.
        probation_base_s: a first quarantine's probation (0: no quarantine).
        can_leave: whether the job stays at or above its minimum without this node now.
        clock: wall-clock time (the events' clock).
    """

    def __init__(self, recorder: JobRecorder, metrics: AgentMetrics | None, *,
                 probation_base_s: float = 0.0, can_leave: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.time) -> None:
        self._recorder = recorder
        self.metrics = metrics
        self._base_s = probation_base_s
        self._can_leave = can_leave
        self._clock = clock
        self._seen: dict[int, float] = {}  # step -> time: the checks that named our ranks
        self.quarantines = 0
        # Reports arrive on the control server's threads, one per worker connection: two ranks
        # named by one check must not both start a quarantine.
        self._lock = threading.Lock()

    def __call__(self, report: DivergenceReport) -> None:
        if self.metrics is not None:
            self.metrics.diverged()
        self._recorder.event(DIVERGED_EVENT, divergence_message(report), rank=report.rank,
                             step=report.step, source=report.source if report.source >= 0 else None,
                             reason=report.reason)
        with self._lock:
            now = self._clock()
            # Two ranks of this node named by one check are one divergence, not two.
            self._seen.setdefault(report.step, now)
            self._seen = {s: t for s, t in self._seen.items() if now - t <= QUARANTINE_WINDOW_S}
            length = quarantine_s(list(self._seen.values()), now, base_s=self._base_s,
                                  earlier=self.quarantines, can_leave=self._can_leave())
            if length > 0:
                self._quarantine(length, report)

    def _quarantine(self, length: float, report: DivergenceReport) -> None:
        """Put this node on probation for ``length`` seconds (``rdzv/probation/<node>`` on a
        lease of that length, fenced on our session): its agent drains and waits as a spare."""
        rec = self._recorder
        node = rec.session.node_id
        record = ProbationRecord(node, ratio=0.0, probation_s=length, ejections=self.quarantines + 1,
                                 round=rec.session.round if rec.session.round is not None else -1,
                                 since=self._clock(), cause=PROBATION_CAUSE)
        try:
            lease = rec.client.grant_lease(max(int(round(length)), 1))
            if not rec.client.txn(rec.session.fence(), [Put(rec.keys.probation(node), record.to_json(),
                                                            lease=lease)]):
                rec.client.revoke_lease(lease)
                return  # our session is gone: the rejoin sorts it out
        except TransientError as exc:
            log.warning("quarantine_not_written", node=node, error=str(exc))
            return
        self.quarantines += 1
        self._seen.clear()  # the next quarantine needs two new divergences
        log.warning("node_quarantined", node=node, probation_s=length, step=report.step)
        rec.event(QUARANTINED_EVENT, f"quarantined for {length:g}s: this node's ranks diverged "
                  f"from their replicas twice within {QUARANTINE_WINDOW_S / 60:g} min (last: rank "
                  f"{report.rank} at step {report.step})", probation_s=length, rank=report.rank)
