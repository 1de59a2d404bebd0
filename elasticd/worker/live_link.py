"""Live re-formation's link to the node's agent: register, park, await the order, confirm,
fall back, and the watcher that takes an order while the loop is blocked.

:class:`~elasticd.worker.live.LiveState` decides when to re-form and moves the state;
everything it says to or hears from its agent goes through one :class:`AgentLink`: the
typed reports on the control socket (``LiveRegistration``, ``ParkedReport``,
``ReformedReport``), the agent's ``reform.json`` order, and the stopped marker that sends
a failed re-formation down the restart path.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import structlog

import elasticd.worker.context as wctx
from elasticd.control.client import ControlClient
from elasticd.control.environment import AgentEnvironment
from elasticd.control.messages import (
    LeaveReason,
    LiveRegistration,
    ParkedReport,
    ReformedReport,
    StoppedReport,
)
from elasticd.control.reform import ReformOrder, clear_stopped, read_order, write_stopped
from elasticd.worker.sockets import shutdown_group_connections

# One wait for the agent's order on the control socket (AwaitOrder): it answers as soon
# as the order is out, so this bounds only how often a watcher with nothing to do asks
# again, and how often it retries an abort that did not wake the loop yet.
WAIT_S = 1.0
AGENT_AWAY_S = 0.5  # the agent did not answer a wait: ask again after this (bounded by the deadline)


class AgentLink:
    """One live worker's side of the agent's re-formation protocol.

    Args:
        env: the agent's environment (None: no agent, the link is off).
        log: the worker's bound logger.
    """

    def __init__(self, env: AgentEnvironment | None, log: structlog.typing.FilteringBoundLogger) -> None:
        self._log = log
        self._in_reform = False
        # Waits on the agent's order, one connection per thread (a wait holds its client).
        socket_path = env.socket_path if env is not None else ""
        self._waiter = ControlClient(socket_path, timeout_s=WAIT_S + 10.0)
        self._watch_waiter = ControlClient(socket_path, timeout_s=WAIT_S + 10.0)
        self._not_reforming = threading.Event()
        self._not_reforming.set()

    def register(self, local_rank: int) -> bool:
        """Tell the agent this worker re-forms in place; True once it acknowledged it
        (unregistered, it restarts us on a change (the plain path), never counts on us)."""
        client = wctx.control_client()
        return client is not None and client.report(LiveRegistration(local_rank=local_rank, pid=os.getpid()))

    def start_watch(self) -> None:
        """Start the watcher thread (see :meth:`_watch`)."""
        threading.Thread(target=self._watch, name="elasticd-live-watch", daemon=True).start()

    @property
    def in_reform(self) -> bool:
        return self._in_reform

    @contextlib.contextmanager
    def reforming(self) -> Iterator[None]:
        """The loop's re-formation: the watcher stands aside until it ends."""
        self._in_reform = True
        self._not_reforming.clear()
        try:
            yield
        finally:
            self._in_reform = False
            self._not_reforming.set()

    def _watch(self) -> None:
        """Take an order for a newer round: at the next step boundary, and by aborting the
        old group (world size > 1) so that a collective blocked on a frozen peer fails.

        A frozen peer (SIGSTOP, a hung host) keeps its sockets open, so the survivors'
        collective with it never fails; the main thread is blocked in C++ where no Python
        signal handler runs. The agent orders the next round once the frozen node's lease
        expires; aborting the old group from this thread makes the blocked collective fail
        at once, and the loop re-forms as after a kill.
        """
        cdir = wctx.control_dir()
        assert cdir is not None
        acted = -1  # the round of the last order acted on: waited past, then acted on again
        while True:
            self._not_reforming.wait()
            current = wctx.current_round()
            try:
                self._watch_waiter.await_order(max(acted, current if current is not None else -1), WAIT_S)
            except OSError:  # the agent is away (restarting us, or gone): nothing to take
                time.sleep(AGENT_AWAY_S)
                continue
            if self._in_reform:
                continue
            order = read_order(cdir)
            current = wctx.current_round()
            if order is None or current is None or order.round <= current or self._in_reform:
                continue
            acted = order.round
            # The loop takes the order at its next step boundary (should_stop), even when
            # none of its collectives fail: a worker alone at world size 1 has no peer to
            # fail on, and without this trained on alone in the superseded round.
            wctx.note_reform_order(order.round)
            if wctx.current_context().world_size == 1:
                continue  # no peer to wait on: nothing to abort, the step boundary is near
            wctx.abort_groups(lambda: not self._in_reform)
            # gloo's abort closes our connections (peers waiting on us fail) but does not
            # wake our own wait on a frozen peer: shutting the connections down does.
            time.sleep(0.2)
            if not self._in_reform and (wctx.current_round() or 0) < order.round:
                closed = shutdown_group_connections(wctx.group_sockets())
                self._log.info("live_connections_shut_down", count=closed, round=order.round)
            time.sleep(1.0)  # the loop notices (a failed collective) and re-forms

    def park(self, cdir: Path, ctx: wctx.WorkerContext, old_round: int, step: int, reason: LeaveReason) -> None:
        """Having left the group: not a drain (we stay), and the agent is told at once."""
        clear_stopped(cdir, ctx.rank)
        client = wctx.control_client()
        # The report wakes the agent's tick: it opens the next round now. Not taken (the
        # agent busy or restarting): its own view of the change may still order us, within
        # the bound; past it we fall back as for any order that did not come.
        parked = ParkedReport(local_rank=ctx.local_rank, round=old_round, step=step, reason=reason)
        if client is not None and not client.report(parked):
            self._log.warning("live_parked_report_not_taken", round=old_round)

    def await_order(self, cdir: Path, local_rank: int, old_round: int, deadline: float,
                    timeout_s: float, step: int) -> ReformOrder:
        """The agent's order for a round newer than ``old_round`` that names this worker;
        past ``deadline``, the restart path (:meth:`fall_back`)."""
        order = read_order(cdir)
        while order is None or order.round <= old_round or local_rank not in order.ranks:
            left = deadline - time.monotonic()
            if left <= 0:
                self.fall_back(f"no new round within {timeout_s:.0f}s", step)
            seen = max(old_round, order.round if order is not None else -1)
            try:  # answered as soon as the agent publishes a newer order
                self._waiter.await_order(seen, min(WAIT_S, left))
            except OSError:
                time.sleep(min(AGENT_AWAY_S, max(left, 0.0)))
            order = read_order(cdir)
        return order

    def confirm(self, local_rank: int, round_: int, step: int) -> None:
        """Re-formed: withdraws our parked report (control.reform.WorkerReports)."""
        client = wctx.control_client()
        if client is not None:
            client.report(ReformedReport(local_rank=local_rank, round=round_, step=step))

    def fall_back(self, why: str, step: int) -> NoReturn:
        """In-place re-formation failed: exit 0 as stopped, so the agent restarts the group."""
        ctx = wctx.current_context()
        cdir = wctx.control_dir()
        self._log.warning("live_reform_fell_back", reason=why, step=step)
        if cdir is not None:
            # A file: read once we have exited. A parked report of ours left with the
            # agent is moot then: the group is no longer running.
            write_stopped(cdir, StoppedReport(rank=ctx.rank, step=max(step, -1),
                                              round=ctx.round if ctx.round is not None else -1,
                                              live_fallback=why[:1000]))
        wctx.fast_exit(0)
