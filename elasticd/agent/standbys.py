"""When the agent starts its warm standbys, and how it waits for them.

A mixin of ``ElasticdAgent``. The pool itself (processes that imported torch and wait to
become a worker) is ``elasticd.agent.warm.StandbyPool``; this is the agent's policy for
it: refill once the group trains, or once a plain script's workers run; wait for them
before a node joins a running job.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState

from elasticd.agent.supervision import AgentPhase, SupervisionSettings
from elasticd.agent.warm import StandbyPool, past_imports
from elasticd.control import ControlChannel
from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler


class StandbyCare:
    """Standby refills and waits (mixed into ``ElasticdAgent``, whose state they use)."""

    settings: SupervisionSettings
    handler: EtcdRendezvousHandler
    control: ControlChannel
    phase: AgentPhase
    standby: StandbyPool
    stop_signals: int
    _worker_group: WorkerGroup
    _worker_envs: dict[int, dict[str, str]]
    _group_started_at: float
    _running_checked_at: float
    _pcontext: Any
    _log: structlog.typing.FilteringBoundLogger

    def _refill_standby(self, state: WorkerState) -> None:
        """Start missing standbys once the group trains (its first step, or a while).

        Not earlier: on a small machine the standbys' imports would slow the workers' own
        start, which is exactly what a recovery waits for.
        """
        if not self.standby.enabled or state != WorkerState.HEALTHY or self.phase.draining:
            return
        if not self.standby.missing(range(self._worker_group.spec.local_world_size)):
            return
        board, now = self.control.progress, time.monotonic()
        trained = board.max_step() >= 0 and now - board.first_advance >= self.settings.standby_delay_s
        if trained or now - self._group_started_at >= self.settings.standby_after_s or self._workers_running(now):
            self.standby.fill(self._worker_envs)

    def _joining_running_job(self) -> bool:
        """A final round without us exists: we join a job that trains (one read, best effort)."""
        from elasticd.records import RoundState

        try:
            kv = self.handler.client.get(self.handler.keys.rdzv_state)
            state = RoundState.from_json(kv.value) if kv is not None else None
        except Exception:  # noqa: BLE001 - only an optimisation: a failed read means "no"
            return False
        return state is not None and state.phase == "final" and self.handler.node_id not in state.members

    def _wait_for_standbys(self, n: int, timeout_s: float = 60.0) -> None:
        """Wait (bounded) until ``n`` standbys finished their imports. The node is already
        registered (``ElasticdAgent._run_loop``): waiting here holds no round open for
        longer than its last call, and leaves none to close without us."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s and not self.stop_signals:
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
        if now - self._running_checked_at < 1.0 or self._pcontext is None:
            return False
        self._running_checked_at = now
        pids = list(self._pcontext.pids().values())
        return bool(pids) and all(past_imports(p) for p in pids)

