"""What the agent writes into etcd besides the rendezvous: events, progress, the checkpoint
pointer. Every write is fenced: it happens only while this node's incarnation (the
create_revision of its leased node key) is still the live one, and the checkpoint
pointer additionally only while our round is the job's current round.

Writes here are best effort for the training: an unreachable etcd delays a record, never
a training step (the agent retries briefly, then logs and moves on).
"""

from __future__ import annotations

import time

import structlog

from elasticd.agent.commits import PendingCommit
from elasticd.agent.history import EtcdHistoryWriter
from elasticd.control.api import CommitOutcome
from elasticd.errors import TransientError
from elasticd.etcd.kv import KV
from elasticd.etcd.txn import Compare, ModRevision, Put
from elasticd.keys import JobKeys
from elasticd.records import Beat, CheckpointPointer, Event, Progress, RoundState
from elasticd.rendezvous.session import NodeSession
from elasticd.retry import call_with_retry
from elasticd.status.goodput import read_events, rollback_losses
from elasticd.status.snapshot import read_history

log = structlog.get_logger(__name__)

MAX_EVENTS = 256
PRUNE_EVERY = 16
# The job's progress record is one key written by rank 0's agent: cheap at any size, so
# often enough that `status` is never seconds behind the training log.
PROGRESS_INTERVAL_S = 1.0


class JobRecorder:
    """Fenced writer of events, progress and the checkpoint pointer for one node.

    Args:
        session: the node's session (``EtcdRendezvousHandler.session``): its incarnation
            fences every write, its round stamps events and progress.
        max_events: the bound of the job's event history.
    """

    def __init__(self, session: NodeSession, *, max_events: int = MAX_EVENTS) -> None:
        self.session = session
        self.client = session.client
        self.keys: JobKeys = session.keys
        self.max_events = max_events
        self._appended = 0
        self._last_progress_at = 0.0
        self._last_progress: Progress | None = None
        self._step_seen: int | None = None  # the newest step progress() was given
        self.history = EtcdHistoryWriter(self.client, self.keys, session.fence)
        self._progress_failing = False  # the last publish failed (logged once per outage)
        self.run_id = ""  # this run's id (/elasticd/<job>/run_id), stamped on the pointer

    def event(self, kind: str, message: str, *, node: str | None = None, **detail: object) -> None:
        """Append an event to the job's bounded history (dropped if etcd stays unreachable).

        ``node`` is the node the event is about (default: this node).
        """
        ev = Event(time=time.time(), kind=kind, node=node or self.session.node_id,
                   round=self.session.round if self.session.round is not None else -1,
                   message=message, detail={k: v for k, v in detail.items() if v is not None})
        key = f"{self.keys.event(time.time_ns() // 1000)}-{ev.node}"
        try:
            call_with_retry(lambda: self.client.txn(self.session.fence(), [Put(key, ev.to_json())]),
                            what="event", deadline=time.monotonic() + 3)
        except TransientError as exc:
            log.warning("event_dropped", kind=kind, error=str(exc))
            return
        self._appended += 1
        if self._appended % PRUNE_EVERY == 0:
            self.prune_events()

    def prune_events(self) -> None:
        """Delete the oldest events beyond ``max_events``."""
        try:
            kvs, _ = self.client.get_prefix(self.keys.events_prefix)
            for kv in kvs[: max(len(kvs) - self.max_events, 0)]:
                self.client.delete(kv.key)
        except TransientError as exc:
            log.warning("event_prune_failed", error=str(exc))

    def progress(self, step: int, epoch: int, samples: int, world_size: int, *, force: bool = False,
                 loss: float | None = None, cadence: tuple[int, float, str] | None = None,
                 step_s: float = 0.0) -> None:
        """Publish job progress (rate-limited to one write per ``PROGRESS_INTERVAL_S``).

        Each published progress is also offered to the bounded history (``history``), with
        ``step_s``, the workers' median seconds per step lately (0: not measured).
        """
        seen, self._step_seen = self._step_seen, step
        if seen is not None and step < seen:
            # Every rollback, also one the rate-limited samples never see (a peer-RAM
            # replica 12 steps back, trained past within one interval): the goodput
            # ledger counts its steps as retrained, the plot marks it.
            self.event("rollback", f"training went back {seen - step} steps, from step "
                       f"{seen} to {step}", steps=seen - step, from_step=seen)
        now = time.time()
        last = self._last_progress
        if not force and (now - self._last_progress_at < PROGRESS_INTERVAL_S
                          or (last is not None and last.step == step)):
            return
        rate = 0.0
        if last is not None and now > last.updated_at and samples >= last.samples_trained:
            rate = (samples - last.samples_trained) / (now - last.updated_at)
        rnd = self.session.round if self.session.round is not None else -1
        every, interval_s, why = cadence if cadence is not None else (0, 0.0, "")
        prog = Progress(round=rnd, step=step, epoch=epoch, samples_trained=samples,
                        samples_per_s=round(rate, 3), world_size=world_size, updated_at=now,
                        save_every=every, save_interval_s=round(interval_s, 3), cadence=why)
        try:
            ok = self.client.txn(self.session.fence(), [Put(self.keys.progress, prog.to_json())])
        except TransientError as exc:
            # Once per outage, and the next try one interval later: not a warning and an
            # etcd call every step while etcd is down (soak seed 880003: 108 lines in 11 s).
            self._last_progress_at = now
            if not self._progress_failing:
                log.warning("progress_not_published", error=str(exc))
            self._progress_failing = True
            return
        if self._progress_failing:
            log.info("progress_published_again", step=step)
            self._progress_failing = False
        if ok:
            self._last_progress, self._last_progress_at = prog, now
            self.history.append(now, step, world_size, prog.samples_per_s, rnd, loss, step_s=step_s)

    def beat(self, step: int, local_world_size: int, *, activity: str = "",
             step_s: float = 0.0, busy_share: float = 0.0) -> None:
        """Write this node's beat (``beats/<node>``, on its lease; see ``records.Beat``).

        Best effort: a beat that fails is the next one's job, and a lost lease is the
        rendezvous handler's to detect, not this writer's.
        """
        lease = self.session.lease_id
        if not lease:
            return
        rnd = self.session.round if self.session.round is not None else -1
        beat = Beat(at=time.time(), round=rnd, step=step, local_world_size=local_world_size,
                    activity=activity, step_s=round(step_s, 4), busy_share=round(busy_share, 3))
        try:
            self.client.put(self.keys.beat(self.session.node_id), beat.to_json(), lease=lease)
        except Exception as exc:  # noqa: BLE001 - unreachable, or the lease just expired
            log.debug("beat_not_written", error=str(exc))

    def observed_losses(self) -> tuple[int, float] | None:
        """The job's rollbacks and the span its history covers (the goodput ledger's facts,
        for the workers' automatic checkpoint cadence); None when etcd does not answer."""
        try:
            history, _ = read_history(self.client, self.keys.job)
            return rollback_losses(history, read_events(self.client, self.keys))
        except TransientError as exc:  # the workers start anyway, on their own observation
            log.info("losses_not_read", error=str(exc))
            return None

    # -- checkpoint pointer (the fenced commit) ------------------------------------------
    def latest_checkpoint(self) -> CheckpointPointer | None:
        kv = self.client.get(self.keys.checkpoint_latest)
        return CheckpointPointer.from_json(kv.value) if kv else None

    def commit_checkpoint(self, step: int, manifest_url: str, world_size: int,
                          round_: int) -> tuple[CommitOutcome, str]:
        """Point ``checkpoint/latest`` at a manifest if our round is current and the step newer.

        One transaction compares: the round state key unchanged since our round completed
        (so the job has not re-formed without us), our node key still our incarnation (our
        lease is alive), and the pointer unchanged since we read it (no concurrent commit).

        Three outcomes, and only a verdict is a refusal: ``REFUSED`` when our round is
        over (the round state moved, or we are in another round) or the pointer already
        names something at least as new. ``UNKNOWN`` when etcd did not answer (down,
        frozen, slow, out of space, token expired: any error), or our lease is gone while
        the round is still ours (an etcd outage expired it; the agent re-registers in the
        same round, or else finds the round moved and the retry is refused).

        Returns:
            (outcome, reason).
        """
        s = self.session
        if s.round is None or round_ != s.round:
            return CommitOutcome.REFUSED, f"stale round {round_} (agent is in round {s.round})"
        state_rev = s.state_rev
        try:
            for _ in range(3):  # the pointer moved under us: read it again and decide again
                outcome, reason, state_rev = self._try_commit(step, manifest_url, world_size,
                                                              round_, state_rev)
                if outcome is not None:
                    return outcome, reason
        except Exception as exc:  # noqa: BLE001 - no answer is not a no
            log.warning("checkpoint_commit_unknown", step=step, round=round_, error=repr(exc))
            return CommitOutcome.UNKNOWN, f"etcd did not answer: {exc!r}"
        return CommitOutcome.UNKNOWN, "the pointer kept moving under concurrent commits"

    def _try_commit(self, step: int, manifest_url: str, world_size: int, round_: int,
                    state_rev: int) -> tuple[CommitOutcome | None, str, int]:
        """One read-compare-swap: (outcome, why, state_rev); outcome None means try again
        with the returned round-state revision (the pointer moved, or the next round opened)."""
        outcome, reason = self._swap_pointer(step, manifest_url, world_size, round_,
                                             [ModRevision(self.keys.rdzv_state, state_rev),
                                              *self.session.fence()])
        if outcome is not None:
            return outcome, reason, state_rev
        # Which compare failed decides the outcome: only a moved round state is a verdict.
        state = self.client.get(self.keys.rdzv_state)
        if state is not None and state.mod_revision != state_rev and _successor_open(state, round_):
            # The next round is open but not formed: nobody trains in it yet, so our save
            # is still the job's newest state (a join or a loss opened it while the upload
            # was in flight). Commit against the open round's revision instead; once the
            # round forms, the compare fails and the verdict below applies.
            return None, "the next round opened", state.mod_revision
        if state is None or state.mod_revision != state_rev:
            return CommitOutcome.REFUSED, (f"fenced: round {round_} is no longer current "
                                           "(the job re-formed without this node)"), state_rev
        node = self.client.get(self.keys.node(self.session.node_id))
        if node is None or node.create_revision != self.session.incarnation:
            return CommitOutcome.UNKNOWN, (f"our lease is gone while round {round_} is still "
                                           "current (an etcd outage?); the agent re-registers"), state_rev
        return None, "the pointer moved", state_rev

    def _swap_pointer(self, step: int, manifest_url: str, world_size: int, round_: int,
                      compares: list[Compare], *,
                      from_intent: bool = False) -> tuple[CommitOutcome | None, str]:
        """The pointer's one compare-and-swap, shared by a commit and a left intent.

        Reads ``checkpoint/latest``; if it already names ``manifest_url`` the commit went
        through earlier; if it is at least as new the step is refused; otherwise puts the
        successor pointer (the job's high-water step carried, this run's id stamped) under
        ``compares`` plus "the pointer is unchanged since we read it".

        Returns:
            (COMMITTED or REFUSED, reason) when decided, (None, "") when a compare failed.
        """
        current = self.client.get(self.keys.checkpoint_latest)
        if _names(current, manifest_url):  # an earlier attempt went through after all
            return CommitOutcome.COMMITTED, "already committed"
        refused = _not_newer(current, step, round_)
        if refused:
            return CommitOutcome.REFUSED, refused
        pointer = CheckpointPointer.successor(
            CheckpointPointer.from_json(current.value) if current is not None else None,
            step=step, round_=round_, manifest_url=manifest_url, committed_at=time.time(),
            world_size=world_size, run_id=self.run_id)
        ok = self.client.txn(
            [*compares,
             ModRevision(self.keys.checkpoint_latest, current.mod_revision if current else 0)],
            [Put(self.keys.checkpoint_latest, pointer.to_json())],
        )
        if not ok:
            return None, ""
        log.info("checkpoint_committed", step=step, round=round_, url=manifest_url,
                 **({"from_intent": True} if from_intent else {}))
        return CommitOutcome.COMMITTED, "committed"

    def commit_intent(self, req: PendingCommit) -> tuple[CommitOutcome, str]:
        """Commit a pending commit left by a previous agent of this node (before joining).

        The fence without the lease (that agent's lease is gone): the round state's
        mod_revision must still be the one the save's round formed with, i.e. nobody
        re-formed the job since, and the pointer must move forward.

        Returns:
            (outcome, reason); ``UNKNOWN`` when etcd did not answer.
        """
        try:
            outcome, reason = self._swap_pointer(
                req.step, req.manifest_url, req.world_size, req.round,
                [ModRevision(self.keys.rdzv_state, req.state_rev)], from_intent=True)
        except Exception as exc:  # noqa: BLE001 - no answer is not a no
            return CommitOutcome.UNKNOWN, f"etcd did not answer: {exc!r}"
        if outcome is None:
            return CommitOutcome.REFUSED, (f"round {req.round} is no longer current (the job "
                                           "re-formed since) or the pointer moved")
        return outcome, reason


def _successor_open(state: KV, round_: int) -> bool:
    """True if the round state KV ``state`` is round ``round_ + 1``, still open."""
    rs = RoundState.from_json(state.value)
    return rs.round == round_ + 1 and rs.phase == "open"


def _names(current: KV | None, manifest_url: str) -> bool:
    """True if the pointer KV ``current`` already names ``manifest_url``."""
    return current is not None and CheckpointPointer.from_json(current.value).manifest_url == manifest_url


def _not_newer(current: KV | None, step: int, round_: int) -> str:
    """Why (step, round) may not replace the pointer ``current`` (a KV or None); "" if it may."""
    if current is None:
        return ""
    cur = CheckpointPointer.from_json(current.value)
    # Forward = a newer round, or the same round and a newer step. (A new round may
    # resume from an older checkpoint when the newest turned out corrupt.)
    if (cur.round, cur.step) >= (round_, step):
        return (f"step {step} of round {round_} is not newer than the committed "
                f"step {cur.step} of round {cur.round}")
    return ""

