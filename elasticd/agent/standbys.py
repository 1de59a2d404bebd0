"""When the agent starts its warm standbys, and how it waits for them.

``StandbyCare``, one of ``ElasticdAgent``'s collaborators. The pool itself (processes that imported torch and wait to
become a worker) is ``elasticd.agent.warm.StandbyPool``; this is the agent's policy for
it: refill once the group trains, or once a plain script's workers run; wait for them
before a node joins a running job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import structlog
from torch.distributed.elastic.agent.server.api import WorkerState

from elasticd.agent.supervision import SupervisionSettings
from elasticd.agent.warm import StandbyPool, past_imports
from elasticd.control import ControlChannel
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler


class StandbyCare:
    """Standby refills and waits for one agent.

    Args:
        settings: the agent's supervision settings (standby delays).
        handler: the rendezvous handler (the round state, read once at start).
        control: the control channel (the progress board).
        standby: the pool of warm standbys.
        pids: the running workers' pids by local rank (empty when none runs).
        log: the agent's bound logger.
    """

    def __init__(self, settings: SupervisionSettings, handler: EtcdRendezvousHandler,
                 control: ControlChannel, standby: StandbyPool,
                 pids: Callable[[], Mapping[int, int]],
                 log: structlog.typing.FilteringBoundLogger) -> None:
        self.settings = settings
        self.handler = handler
        self.control = control
        self.standby = standby
        self._pids = pids
        self._log = log
        self._running_checked_at = 0.0

    def refill(self, state: WorkerState, *, draining: bool, local_world_size: int,
               envs: Mapping[int, dict[str, str]], group_started_at: float) -> None:
        """Start missing standbys once the group trains (its first step, or a while).

        Not earlier: on a small machine the standbys' imports would slow the workers' own
        start, which is exactly what a recovery waits for.

        Args:
            state: the worker group's state this tick.
            draining: this node leaves (no standby is needed any more).
            local_world_size: workers per node (a standby for each).
            envs: each local rank's worker environment (what a standby becomes).
            group_started_at: when the current worker group started (monotonic).
        """
        if not self.standby.enabled or not self.settings.standby_refill \
                or state != WorkerState.HEALTHY or draining:
            return
        if not self.standby.missing(range(local_world_size)):
            return
        board, now = self.control.progress, time.monotonic()
        trained = board.max_step() >= 0 and now - board.first_advance >= self.settings.standby_delay_s
        if trained or now - group_started_at >= self.settings.standby_after_s or self._workers_running(now):
            self.standby.fill(dict(envs))

    def joining_running_job(self) -> bool:
        """A final round without us exists: we join a job that trains (one read, best effort)."""
        from elasticd.records import RoundState

        try:
            kv = self.handler.client.get(self.handler.keys.rdzv_state)
            state = RoundState.from_json(kv.value) if kv is not None else None
        except Exception:  # noqa: BLE001 - only an optimisation: a failed read means "no"
            return False
        return state is not None and state.phase == "final" and self.handler.node_id not in state.members

    def wait_for_standbys(self, n: int, stopped: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Wait (bounded) until ``n`` standbys finished their imports, or ``stopped()``.
        The node is already registered (``ElasticdAgent._run_loop``): waiting here holds
        no round open for longer than its last call, and leaves none to close without us."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s and not stopped():
            if self.standby.ready(range(n)):
                self._log.info("standbys_ready", seconds=round(time.monotonic() - start, 2))
                return
            # A stat per local rank per look, for the seconds of one import: the node's
            # join waits on this look, so it is frequent (it was 50 ms: 25 ms on average).
            time.sleep(0.01)

    def _workers_running(self, now: float) -> bool:
        """A plain script's group runs (every worker is past its imports), checked ≤ 1/s.

        Such scripts report no steps, so this is what lets their standbys be refilled as
        soon as the new group runs rather than ``standby_after_s`` later: a second fault
        soon after the first then still finds a warm worker.
        """
        if now - self._running_checked_at < 1.0:
            return False
        self._running_checked_at = now
        pids = list(self._pids().values())
        return bool(pids) and all(past_imports(p) for p in pids)

