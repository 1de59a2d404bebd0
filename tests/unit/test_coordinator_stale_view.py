"""The coordinator decides nothing while one of its full watches (nodes/, joins/,
failures/) is disconnected, and a last call starts over once they resume
(``RoundCoordinator._step``).

Why: after an etcd restart a watch can be back seconds after etcd is; meanwhile its table
misses what changed (soak seed 73010: the coordinator's joins/ watch was deaf, it closed an
open round's last call without the three members that had joined it, and one node trained
alone from an older checkpoint). The view is a real ``WatchedView`` fed directly; the
watches are stand-ins with a ``connected`` flag, and a fake client records the writes."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from elasticd.etcd.kv import KV, WatchEvent
from elasticd.keys import JobKeys
from elasticd.records import RoundState
from elasticd.rendezvous.coordinator import RoundCoordinator
from elasticd.rendezvous.protocol import ActionKind
from elasticd.rendezvous.view import WatchedView

K = JobKeys("job")


def kv(key: str, value: str, rev: int) -> KV:
    return KV(key, value.encode(), rev, rev, 0)


class FakeClient:
    last_trouble_at = float("-inf")

    def txn(self, compares: list, success: list) -> bool:
        raise AssertionError("the coordinator wrote to etcd")


def _coordinator(finalized: list) -> tuple[RoundCoordinator, WatchedView, dict]:
    view = WatchedView(K, "n3")
    # Round 1 is open: n0..n2 trained in round 0, n3 is the joiner (and the coordinator).
    view.on_rdzv_resync([kv(K.rdzv_coordinator, "n3", 2),
                         kv(K.rdzv_state, RoundState(1, "open", ["n0", "n1", "n2"], 1, 4).to_json(), 3)],
                        3)
    view.on_nodes_resync([kv(K.node(n), "{}", 10 + i) for i, n in enumerate(["n0", "n1", "n2", "n3"])],
                         20)
    view.on_joins_resync([kv(K.join(1, "n3"), "1", 21)], 21)
    view.set_full(True)
    session = SimpleNamespace(node_id="n3", keeper=object(), lease_lost=threading.Event(), lease_id=7)
    c = RoundCoordinator(FakeClient(), K, session, view, min_nodes=1, max_nodes=4,
                         last_call_timeout_s=0.05,
                         finalize=lambda action, v, rev: finalized.append(action) or True,
                         open_next=lambda *a, **k: True, defer_lost_until=lambda v: None)
    watches = {name: SimpleNamespace(name=name, connected=threading.Event())
               for name in ("nodes", "joins", "failures")}
    for w in watches.values():
        w.connected.set()
    c._watches = list(watches.values())
    return c, view, watches


def _last_call_over(c: RoundCoordinator) -> None:
    """Step until the open round's last call has started, then let it pass."""
    c._step()
    assert c._memory.min_reached_at, "the last call did not start"
    c._memory.min_reached_at[1] -= 1.0  # its 0.05 s passed long ago


def test_a_disconnected_joins_watch_holds_every_decision():
    finalized: list = []
    c, view, watches = _coordinator(finalized)
    _last_call_over(c)
    watches["joins"].connected.clear()  # its stream broke: etcd restarted
    assert c._step() is None
    assert finalized == [], "a round was closed from a view missing joins"


def test_the_last_call_starts_over_when_the_watches_resume():
    finalized: list = []
    c, view, watches = _coordinator(finalized)
    _last_call_over(c)
    watches["joins"].connected.clear()
    c._step()
    watches["joins"].connected.set()
    # The first look after the resume waits a whole last call again: the joins missed
    # meanwhile are being replayed.
    c._step()
    assert finalized == []
    assert c._memory.min_reached_at[1] > time.monotonic() - 0.05
    # Replayed: the members joined while the watch was down.
    view.on_joins([WatchEvent(K.join(1, n), b"1", 30 + i) for i, n in enumerate(["n0", "n1", "n2"])])
    c._step()
    (action,) = finalized
    assert action.kind is ActionKind.FINALIZE
    assert sorted(action.members) == ["n0", "n1", "n2", "n3"]


def test_with_every_watch_connected_the_last_call_closes_the_round():
    """The control: the same view, watches connected, closes without the stragglers."""
    finalized: list = []
    c, view, watches = _coordinator(finalized)
    _last_call_over(c)
    c._step()
    (action,) = finalized
    assert action.kind is ActionKind.FINALIZE and list(action.members) == ["n3"]
