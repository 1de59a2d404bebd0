"""Live re-formation, agent side: re-form the worker group in place instead of restarting it.

When every local worker registered for live re-formation (a ``LiveRegistration`` sent by
``elasticd.worker.LiveState`` over the control socket), a membership change does not kill them. The agent:

- on a node joining, asks them to leave the group at the next agreed step (``park``);
- on a peer lost or drained, or once its workers parked (a collective failed: a peer died,
  which is seen within milliseconds, long before the lease expires), runs the next
  rendezvous round at once while they wait, and writes the new round's ranks and
  bootstrap address to ``reform.json`` (and tells the workers waiting on the socket);
- waits (bounded by ``live_reform_timeout_s``) for every worker to report it re-formed;
  past the bound it falls back to today's restart, with one log line saying why. Workers
  that fail while it is under way (a crash, or a refused commit in the superseded round)
  are started again cold in the round being re-formed, as a joiner's, never through a
  newer round (the peers would fall back to the checkpoint);
- keeps its node record ``re-forming`` from the order until every worker confirmed, so
  ``elasticd status`` never reports a member as training in a round its workers are not
  in yet.

The decision is part of the one pure policy (``policy.decide``, over ``Facts.live``);
here are the thin parts that carry it out: :class:`LiveReformer` reads and writes the
control directory, :class:`LiveReformation` carries out the live verdicts with what it is
given (the rendezvous handler, the control channel, the recorder, the worker-group port).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import structlog

from elasticd.agent.policy import Decision, LiveFacts, LivePhase, Verdict
from elasticd.agent.recorder import JobRecorder
from elasticd.control.api import PARK_FILE, REFORM_FILE
from elasticd.control.messages import LeaveReason, LiveRegistration, ParkedReport, ReformedReport
from elasticd.control.reform import ReformOrder, write_atomic, write_order
from elasticd.control.server import ControlChannel
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler

log = structlog.get_logger(__name__)


class LiveReformer:
    """The control-channel side of live re-formation for one agent: the workers' reports
    (``control.reports``), the park file, the order (``reform.json`` and ``control.orders``).

    Args:
        control: the agent's control channel.
        enabled: ``workers.live_reform``.
        timeout_s: bound on one re-formation (and on a park).
    """

    def __init__(self, control: ControlChannel, *, enabled: bool, timeout_s: float) -> None:
        self.dir = Path(control.dir)
        self.reports = control.reports
        self.orders = control.orders
        self.enabled = enabled
        self.timeout_s = timeout_s
        self.phase = LivePhase.IDLE
        self.reforming_round: int | None = None
        self.deadline = 0.0
        self.nobody_left = False  # the order's round kept every node of the one before

    def workers_live(self, local_world_size: int) -> bool:
        return self.enabled and len(self.reports.get(LiveRegistration)) >= local_world_size

    def facts(self, *, local_world_size: int, now: float) -> LiveFacts | None:
        """This tick's live facts; None when live re-formation is off or some local worker
        did not register for it (the restart policy alone decides then)."""
        if not self.workers_live(local_world_size):
            return None
        waiting = self.reports.get(ParkedReport)
        reforming = self.phase is LivePhase.REFORMING
        done = self.reports.get(ReformedReport) if reforming else {}
        new_round = {r for r, d in done.items() if d.round == self.reforming_round}
        return LiveFacts(
            phase=self.phase,
            parked_all=len(waiting) >= local_world_size,
            parked_any_failure=any(p.reason is LeaveReason.COLLECTIVE_FAILED for p in waiting.values()),
            reformed_all=reforming and len(new_round) >= local_world_size,
            left_old_all=reforming and len(new_round | set(waiting)) >= local_world_size,
            deadline_passed=self.phase is not LivePhase.IDLE and now >= self.deadline,
            nobody_left=reforming and self.nobody_left,
        )

    def park(self, now: float) -> None:
        write_atomic(self.dir / PARK_FILE, "join")
        self.phase = LivePhase.PARKING
        self.deadline = now + self.timeout_s

    def order(self, order: ReformOrder, now: float, *, nobody_left: bool = False) -> None:
        """Publish the new round to the workers (their parked markers are theirs to clear).
        ``nobody_left``: the new round holds every node of the one before it."""
        (self.dir / PARK_FILE).unlink(missing_ok=True)
        write_order(self.dir, order)
        self.orders.published(order.round)  # the workers waiting on the socket read it now
        self.phase = LivePhase.REFORMING
        self.reforming_round = order.round
        self.deadline = now + self.timeout_s
        self.nobody_left = nobody_left

    def finish(self) -> None:
        """The re-formation ended (done or fallen back): forget it."""
        self.phase = LivePhase.IDLE
        self.reforming_round = None
        self.nobody_left = False
        (self.dir / PARK_FILE).unlink(missing_ok=True)
        self.reports.clear(ReformedReport)

    def reset_group(self) -> None:
        """A new worker group starts (restart path): no live state, no order, no markers."""
        self.finish()
        (self.dir / REFORM_FILE).unlink(missing_ok=True)
        self.orders.reset()
        self.reports.clear(LiveRegistration)
        self.reports.clear(ParkedReport)


class WorkerGroupPort(Protocol):
    """The worker group as live re-formation needs it: rejoin with the workers running."""

    @property
    def local_world_size(self) -> int: ...

    def rejoin_keeping_workers(self) -> ReformOrder:
        """Run the next rendezvous round while the workers keep running; their order."""
        ...


class LiveReformation:
    """Carries out the live verdicts of ``policy.decide`` for one agent.

    Args:
        reformer: the control-directory side (order, park, the workers' reports).
        handler: the rendezvous handler (its round, for logs and the order).
        control: the control channel (drain file, progress board).
        recorder: the job's event recorder.
        group: the worker group, through the port that rejoins with the workers running.
    """

    def __init__(self, reformer: LiveReformer, handler: EtcdRendezvousHandler,
                 control: ControlChannel, recorder: JobRecorder, group: WorkerGroupPort) -> None:
        self.reformer = reformer
        self.handler = handler
        self.control = control
        self.recorder = recorder
        self.group = group
        self._log = log.bind(job=handler.keys.job, node=handler.node_id)
        self._measured_group: float | None = None  # the start time of the group measured last
        self._registered_after_s: float | None = None

    @property
    def enabled(self) -> bool:
        return self.reformer.enabled

    def facts(self, now: float) -> LiveFacts | None:
        """This tick's ``Facts.live`` (None: the restart policy alone decides)."""
        if not self.reformer.enabled:
            return None
        return self.reformer.facts(local_world_size=self.group.local_world_size, now=now)

    def registered_after(self, *, now: float, group_started_at: float) -> float | None:
        """``Facts.registered_after_s``: the longest a worker group of this agent took until
        every local worker registered (measured on the first tick that sees it), or None
        while none ever did."""
        if (self.reformer.enabled and self._measured_group != group_started_at
                and self.reformer.workers_live(self.group.local_world_size)):
            self._measured_group = group_started_at
            took = now - group_started_at
            self._registered_after_s = max(took, self._registered_after_s or 0.0)
        return self._registered_after_s

    def starting(self, *, now: float, group_started_at: float, any_step: bool) -> bool:
        """``Facts.live_starting``: live re-formation is on, but the workers of a group started
        less than ``timeout_s`` ago have not all registered nor trained a step yet (a join then
        waits for them instead of restarting the group)."""
        return (self.reformer.enabled and not any_step
                and not self.reformer.workers_live(self.group.local_world_size)
                and now - group_started_at < self.reformer.timeout_s)

    def abandon(self, decision: Decision) -> None:
        """The workers ended mid-way: forget the re-formation (``decision`` still acts)."""
        self._log.info("live_reform_abandoned", reason=decision.live_abandoned)
        self.reformer.finish()

    def park(self, reason: str, now: float) -> None:
        """Ask the workers to leave their group at the next agreed step (nodes join)."""
        self._log.info("live_park_requested", reason=reason, round=self.handler.round)
        self.reformer.park(now)

    def completed(self, seconds: float) -> None:
        """Every worker confirmed the new round (the agent sets its record to training)."""
        self._log.info("live_reform_completed", round=self.handler.round, seconds=round(seconds, 3))
        self.recorder.event("reform", f"workers re-formed in place in round {self.handler.round}",
                            seconds=round(seconds, 3))
        self.reformer.finish()

    def restarted_in_round(self, reason: str) -> None:
        """Our workers failed during the re-formation: forget it (the agent starts new
        workers in its round; the peers keep re-forming, and send them the state)."""
        self._log.warning("live_reform_workers_restarted", reason=reason, round=self.handler.round)
        self.reformer.reset_group()

    def fell_back(self, reason: str) -> None:
        """In place did not work: forget it all (the agent restarts the workers)."""
        # The one line that says why in place did not work; then today's restart path.
        self._log.warning("live_reform_fell_back", reason=reason, round=self.handler.round)
        self.reformer.reset_group()

    def reform(self, reason: str, *, draining: bool) -> ReformOrder:
        """Run the next rendezvous round with the workers alive and order them into it.

        The round's etcd records are the caller's to write, after this returns: the workers
        re-form meanwhile (they were on the critical path, 10-70 ms under load, when
        written before the order).
        """
        old_round, old_members = self.handler.round, set(self.handler.members)
        self._log.info("live_reform_started", reason=reason, round=old_round)
        order = self.group.rejoin_keeping_workers()
        if not draining:
            self.control.clear_drain()
        self.control.progress.reset()
        self.reformer.order(order, time.monotonic(),  # the bound runs from the order
                            nobody_left=bool(old_members) and old_members <= set(self.handler.members))
        self._log.info("live_reform_ordered", round=order.round, world_size=order.world_size,
                       ranks=order.ranks, old_round=old_round)
        return order


LIVE_VERDICTS = (Verdict.PARK, Verdict.REFORM_LIVE, Verdict.LIVE_WAIT, Verdict.LIVE_DONE,
                 Verdict.LIVE_FALLBACK)


# A group counts as a plain script's once every worker has been past its imports this long
# without one writing the worker API's ``api-`` marker (written before the first socket).
PLAIN_GRACE_S = 2.0
PLAIN_LOOK_EVERY_S = 0.5  # /proc is read at most this often, and never again once past


class PlainScriptWatch:
    """``Facts.workers_plain``: this worker group runs a script that does not use the worker
    API, so it will never register for live re-formation (a join must not wait for it).

    Why: a node's first worker group defers a join while its workers may still register
    (``policy.may_still_register``); a plain script never does, so every join in its
    first ``live_reform_timeout_s`` waited that long (test_membership's joiner: 26 s). The
    worker API writes ``api-<local rank>`` at ``init()``, before the process group opens
    its first socket; workers that are past their imports (``warm.past_imports``: torch
    mapped, a socket open) for ``grace_s`` without one are a plain script's. A script that
    opens a socket of its own before ``worker.init()`` may be taken for one during its
    start-up: a join then restarts its group (nothing trained yet), as before the deferral.

    Args:
        past_imports: whether a pid is past its imports (``elasticd.agent.warm.past_imports``).
        grace_s: how long past the imports without a marker makes a plain script.
        look_every_s: how often /proc is read until every worker is past its imports.
    """

    def __init__(self, past_imports: Callable[[int], bool], grace_s: float = PLAIN_GRACE_S,
                 look_every_s: float = PLAIN_LOOK_EVERY_S) -> None:
        self._past_imports = past_imports
        self.grace_s, self.look_every_s = grace_s, look_every_s
        self._group: float | None = None
        self._past_since: float | None = None
        self._looked_at = float("-inf")
        self._on_api = False

    def plain(self, *, now: float, group_started_at: float, pids: Iterable[int],
              on_api: Callable[[], bool]) -> bool:
        """Whether the group started at ``group_started_at`` (its workers ``pids``; ``on_api``:
        whether one wrote the marker, asked only when it decides) runs a plain script, as of
        ``now``. A marker, once seen, stands for the group (the agent clears them per group)."""
        if self._group != group_started_at:
            self._group, self._past_since, self._looked_at = group_started_at, None, float("-inf")
            self._on_api = False
        self._on_api = self._on_api or on_api()
        if self._on_api:
            return False
        if self._past_since is None:
            if now - self._looked_at < self.look_every_s:
                return False
            self._looked_at = now
            running = list(pids)
            if running and all(self._past_imports(p) for p in running):
                self._past_since = now
            return False
        return now - self._past_since >= self.grace_s
