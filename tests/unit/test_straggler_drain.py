"""The coordinator ejects a straggler in two steps (``RoundCoordinator._drain_first``):
first only its probation, fenced on the round state (its agent drains its workers at the
next agreed step); the next round is opened naming it (its workers killed) only once it has
been on probation for ``drain_bound_s`` while still a member. A fake etcd client records
the writes; the clock is monotonic time, the bound is read from the module."""

from __future__ import annotations

import time
from collections import deque
from types import SimpleNamespace

import structlog

from elasticd.etcd.txn import ModRevision, Put
from elasticd.keys import JobKeys
from elasticd.records import ProbationRecord, RoundState
from elasticd.rendezvous import coordinator as coordinator_mod
from elasticd.rendezvous.coordinator import RoundCoordinator
from elasticd.rendezvous.protocol import RendezvousView
from elasticd.rendezvous.stragglers import StragglerWatch


class FakeClient:
    def __init__(self, txn_ok: bool = True) -> None:
        self.txns: list[tuple[list, list]] = []
        self.revoked: list[int] = []
        self.txn_ok = txn_ok

    def grant_lease(self, ttl: int) -> int:
        return 1000 + ttl

    def txn(self, compares: list, success: list) -> bool:
        self.txns.append((compares, success))
        return self.txn_ok

    def revoke_lease(self, lease: int) -> None:
        self.revoked.append(lease)


def _coordinator(client: FakeClient) -> RoundCoordinator:
    c = RoundCoordinator.__new__(RoundCoordinator)  # only the straggler part's state
    c.client, c.keys = client, JobKeys("job")
    c.stragglers = StragglerWatch()
    c.stragglers.samples = {"n0": deque([(0.0, 0.1)]), "n2": deque([(0.0, 0.9)])}
    c.straggler_probation_s, c._slow_ejections = 60.0, {}
    c._flagged, c._draining = {"n2": 3.9}, None
    c._log = structlog.get_logger("test")
    return c


def _view(probation: dict[str, str] | None = None, round_: int = 4) -> RendezvousView:
    state = RoundState(round_, "final", ["n0", "n1", "n2"], 2, 3)
    return RendezvousView(state=state, alive=frozenset({"n0", "n1", "n2"}), probation=probation or {})


def test_the_first_sight_writes_only_the_probation_fenced_on_the_round_state():
    client = FakeClient()
    c = _coordinator(client)
    slow, until = c._drain_first(("n2", "3.9x"), _view(), state_rev=77)
    assert slow is None and until is not None  # no round opened: the agent drains
    (compares, ops), = client.txns
    assert compares == [ModRevision(c.keys.rdzv_state, 77)]
    (put,) = ops
    assert isinstance(put, Put) and put.key == c.keys.probation("n2") and put.lease == 1060
    record = ProbationRecord.from_json(put.value)
    assert (record.node, record.round, record.probation_s, record.ejections) == ("n2", 4, 60.0, 1)
    # The bound is 10 of the straggler's own 0.9 s steps.
    assert 8.5 < until - time.monotonic() <= coordinator_mod.drain_bound_s(0.9)


def test_a_round_that_moved_writes_nothing_and_revokes_the_lease():
    client = FakeClient(txn_ok=False)
    c = _coordinator(client)
    assert c._drain_first(("n2", "3.9x"), _view(), state_rev=77) == (None, None)
    assert client.revoked == [1060] and c._slow_ejections == {}


def test_still_a_member_after_the_bound_it_is_ejected_by_the_next_round(monkeypatch):
    client = FakeClient()
    c = _coordinator(client)
    c._drain_first(("n2", "3.9x"), _view(), state_rev=77)
    on_probation = _view({"n2": "on probation for 60s"})
    slow, until = c._drain_first(("n2", "3.9x"), on_probation, state_rev=78)
    assert slow is None and until is not None and len(client.txns) == 1  # waits, writes nothing
    later = time.monotonic() + 10.0
    monkeypatch.setattr(coordinator_mod.time, "monotonic", lambda: later)
    slow, until = c._drain_first(("n2", "3.9x"), on_probation, state_rev=78)
    assert slow is not None and slow[0] == "n2" and "did not stop at a step" in slow[1]
    assert until is None and len(client.txns) == 1  # the probation is not written again


def test_a_new_coordinator_finding_it_on_probation_gives_it_the_bound_from_now():
    c = _coordinator(FakeClient())
    slow, until = c._drain_first(("n2", "3.9x"), _view({"n2": "on probation"}), state_rev=5)
    assert slow is None and until is not None and until > time.monotonic()
    assert c._draining is not None and c._draining[:2] == ("n2", 4)
    # The same node in a later round (admitted again, flagged again) is a new drain.
    slow, _ = c._drain_first(("n2", "3.9x"), _view({"n2": "on probation"}, round_=9), state_rev=6)
    assert slow is None and c._draining[:2] == ("n2", 9)


def test_the_agent_reads_a_drain_only_while_a_member_of_its_own_final_round():
    from elasticd.rendezvous.etcd_handler import EtcdRendezvousHandler

    def asked(view: RendezvousView, my_round: int | None, me: str = "n2") -> str:
        fake = SimpleNamespace(session=SimpleNamespace(round=my_round), node_id=me,
                               _view=SimpleNamespace(snapshot=lambda: (view, 0)))
        return EtcdRendezvousHandler.asked_to_drain(fake)  # type: ignore[arg-type]

    on = _view({"n2": "on probation for 60s"})
    assert asked(on, 4) == "on probation for 60s"
    assert asked(on, 3) == ""  # a stale round of ours
    assert asked(on, None) == ""
    assert asked(on, 4, me="n1") == ""  # someone else's probation
    assert asked(_view(), 4) == ""
    opened = RendezvousView(state=RoundState(4, "open", ["n0", "n1", "n2"], 2, 3),
                            alive=frozenset(), probation={"n2": "x"})
    assert asked(opened, 4) == ""
