"""A finished job stays finished: what a node arriving after the finish says, and the one
explicit way to run the job again (``elasticd start``).

Why: a node killed near the end of a job and started again after its peers finished
(systemd's ``Restart=on-failure``, a reboot, an operator re-running the same command) used
to find the job closed with no live node, reopen it and train the job again alone from
its own stale snapshot, overwriting the finished run's output. A node cannot tell "I
was part of the run that finished" from "somebody wants a new run"; the operator can. So
an agent that arrives at a finished job exits 0 with one line (when it finished, at which
step, how to run it again), and only ``elasticd start --job J`` reopens it.

``rdzv/closed`` holds a :class:`~elasticd.records.ClosedRecord` (written by the agent
whose workers finished: ``EtcdRendezvousHandler.set_closed``). This module is torch-free:
the agent checks it before importing torch (``elasticd.agent.boot``) and
``elasticd start`` uses it. Pure functions decide and word; the two that take an
``EtcdClient`` do the I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys
from elasticd.records import ClosedRecord, Progress, RecordError


@dataclass(frozen=True)
class FinishedJob:
    """What is known of a job's finish (None: not recorded)."""

    job: str
    finished_at: float | None = None
    step: int | None = None  # the last step its workers reported (plain scripts report none)
    round: int | None = None
    node: str = ""  # whose workers finished first (who closed it)


def finished_job(job: str, closed: bytes, progress: bytes | None) -> FinishedJob:
    """The finish as recorded: the ``rdzv/closed`` value and the ``progress`` record. Pure.

    Untrusted input: a close that is not a valid record (an older agent's ``1``) is still
    a close, with time and round unknown; an unreadable progress record means no step.
    """
    try:
        rec: ClosedRecord | None = ClosedRecord.from_json(closed)
    except RecordError:
        rec = None
    step: int | None = None
    if progress is not None:
        try:
            step = Progress.from_json(progress).step
        except RecordError:
            step = None
    return FinishedJob(job, finished_at=rec.finished_at if rec else None,
                       step=step if step is not None and step >= 0 else None,
                       round=rec.round if rec and rec.round >= 0 else None,
                       node=rec.node if rec else "")


def finished_notice(f: FinishedJob) -> tuple[str, str]:
    """``(reason, fix)``: the line an agent that arrives at a finished job logs. Pure."""
    at = f" at step {f.step}" if f.step is not None else ""
    when = (time.strftime(" on %Y-%m-%d %H:%M:%S UTC", time.gmtime(f.finished_at))
            if f.finished_at is not None else "")
    where = f" (round {f.round}, closed by {f.node})" if f.round is not None and f.node else ""
    reason = f"job {f.job!r} finished{at}{when}{where}; this node does not run it again"
    fix = (f"to run it again, `elasticd start --job {f.job}` reopens it (the workers resume "
           "from its newest checkpoint), then start the agents; for a fresh run, use a new "
           "job name")
    return reason, fix


def read_finished(client: EtcdClient, keys: JobKeys) -> FinishedJob | None:
    """The job's finish, or None if it is not finished (two reads).

    Raises:
        EtcdUnavailableError: etcd did not answer.
    """
    closed = client.get(keys.rdzv_closed)
    if closed is None:
        return None
    progress = client.get(keys.progress)
    return finished_job(keys.job, closed.value, progress.value if progress else None)


@dataclass(frozen=True)
class Reopen:
    """What :func:`reopen_finished` did."""

    reopened: bool
    finished: FinishedJob | None = None  # None: the job was not finished
    live: tuple[str, ...] = ()  # nodes still registered (a finish in progress): not reopened


def reopen_finished(client: EtcdClient, keys: JobKeys) -> Reopen:
    """Reopen a finished job for another run (``elasticd start``): delete its rendezvous
    and per-round stores, so the next agents form round 0 again.

    The run id, progress, events and the checkpoint pointer stay: the next run is the
    same run continued (its workers resume from its newest checkpoint). Refused while a
    node of the job is still registered (its agent is finishing). The delete is one
    transaction guarded by the close's mod_revision: two operators reopening at once
    delete once, and a round formed after the first reopen is never wiped by the second.

    Raises:
        EtcdUnavailableError: etcd did not answer.
    """
    closed = client.get(keys.rdzv_closed)
    if closed is None:
        return Reopen(False)
    progress = client.get(keys.progress)
    finished = finished_job(keys.job, closed.value, progress.value if progress else None)
    nodes, _ = client.get_prefix(keys.nodes_prefix, keys_only=True)
    live = tuple(sorted(kv.key[len(keys.nodes_prefix):] for kv in nodes))
    if live:
        return Reopen(False, finished, live)
    # False: someone reopened it first (the close changed or is gone): reopened either way.
    client.delete_prefixes_if(keys.rdzv_closed, mod_revision=closed.mod_revision,
                              prefixes=[keys.rdzv_prefix, keys.store_root])
    return Reopen(True, finished)
