"""When the agent refills its standbys once the workers train (``StandbyCare.refill``)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import structlog
from torch.distributed.elastic.agent.server.api import WorkerState

from elasticd.agent.standbys import StandbyCare
from elasticd.agent.supervision import SupervisionSettings
from elasticd.control.server import ProgressBoard


class _Pool:
    """The pool's surface that ``refill`` uses: which ranks miss a standby, and fills."""

    def __init__(self) -> None:
        self.enabled = True
        self.fills: list[dict] = []

    def missing(self, local_ranks: range) -> list[int]:
        return [] if self.fills else list(local_ranks)

    def fill(self, envs: dict) -> None:
        self.fills.append(envs)


def _care(**settings) -> tuple[StandbyCare, _Pool, ProgressBoard]:
    board, pool = ProgressBoard(), _Pool()
    care = StandbyCare(SupervisionSettings(standby_delay_s=0.0, **settings), handler=None,
                       control=SimpleNamespace(progress=board), standby=pool, pids=dict,
                       log=structlog.get_logger())
    return care, pool, board


def _refill(care: StandbyCare, state: WorkerState = WorkerState.HEALTHY, draining: bool = False) -> None:
    care.refill(state, draining=draining, local_world_size=2, envs={0: {}, 1: {}},
                group_started_at=time.monotonic())


def test_standbys_are_refilled_once_the_group_trains():
    care, pool, board = _care()
    _refill(care)
    assert pool.fills == [], "refilled before the group trained"
    board.report(0, step=0, epoch=0, samples=8)
    _refill(care)
    assert pool.fills == [{0: {}, 1: {}}]


@pytest.mark.parametrize("why", ["refill off", "draining", "unhealthy"])
def test_no_refill_when_off_draining_or_unhealthy(why):
    care, pool, board = _care(standby_refill=why != "refill off")
    board.report(0, step=3, epoch=0, samples=8)
    _refill(care, state=WorkerState.UNHEALTHY if why == "unhealthy" else WorkerState.HEALTHY,
            draining=why == "draining")
    assert pool.fills == []
