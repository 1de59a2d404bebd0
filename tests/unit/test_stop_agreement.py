"""The stop agreement: every rank reads the previous call's all-reduced flags, so all ranks
stop at the same call; the drain answers say whether every rank or some rank drains."""

from __future__ import annotations

import pytest
import torch

from elasticd.worker import stop_agreement
from elasticd.worker.stop_agreement import StopAgreement

pytestmark = pytest.mark.timeout(10)


class _Peers:
    """The other ranks' flags, MAX-reduced into ours when the work is waited for."""

    def __init__(self) -> None:
        self.theirs = torch.zeros(3, dtype=torch.int32)
        self.started = 0

    def all_reduce(self, flag: torch.Tensor, *, op: object, group: object, async_op: bool) -> object:
        self.started += 1
        peers = self

        class Work:
            def wait(self, timeout: object = None) -> bool:
                torch.maximum(flag, peers.theirs, out=flag)
                return True

        return Work()


def test_a_peer_asking_to_stop_is_agreed_one_call_later(monkeypatch):
    """A peer's drain flag is read at the call after the one that sent it, and the answer
    says some (not every) rank drains; no new all-reduce is started once stopped."""
    peers = _Peers()
    monkeypatch.setattr(stop_agreement.dist, "all_reduce", peers.all_reduce)
    agreement = StopAgreement()
    assert not agreement.agree(local=False, draining=False)  # nothing pending yet
    peers.theirs = torch.tensor([1, 0, 1], dtype=torch.int32)  # a peer's node drains
    assert agreement.agree(local=False, draining=False)
    assert agreement.some_rank_draining() and not agreement.every_rank_draining()
    assert peers.started == 1


def test_every_rank_draining_is_a_whole_job_stop(monkeypatch):
    """When this rank and every peer drain, the agreement says every rank drains."""
    peers = _Peers()
    monkeypatch.setattr(stop_agreement.dist, "all_reduce", peers.all_reduce)
    agreement = StopAgreement()
    peers.theirs = torch.tensor([1, -1, 1], dtype=torch.int32)
    assert not agreement.agree(local=True, draining=True)
    assert agreement.agree(local=True, draining=True) and agreement.every_rank_draining()


def test_a_single_rank_agrees_with_itself_without_a_collective(monkeypatch):
    """Alone, the answer is this rank's own flag and no all-reduce is started."""
    monkeypatch.setattr(stop_agreement.dist, "all_reduce", lambda *a, **k: pytest.fail("a collective"))
    agreement = StopAgreement()
    assert agreement.alone(local=True, draining=True) and agreement.every_rank_draining()
    assert not agreement.alone(local=False, draining=False) and not agreement.some_rank_draining()
