"""The pure rules of fast kill detection: a straggler or peer proven dead by a liveness probe.

A refused probe proves an agent gone before its lease expires; these tests pin what the
round protocol and the failure attribution do with that fact (and what they do not).
"""

from __future__ import annotations

from elasticd.records import RoundState
from elasticd.rendezvous.liveness import PeerProber, ProbeTarget
from elasticd.rendezvous.protocol import (
    ActionKind,
    Attribution,
    CoordinatorMemory,
    JoinProgress,
    RendezvousView,
    attribute_failure,
    decide_coordination,
    decide_join,
)

NOW = 100.0
FAR = 1e9


def _open(r: int, members=()) -> RoundState:
    return RoundState(r, "open", list(members), 2, 4)


def _view(state, alive, joins, *, coordinator="a", failures=None) -> RendezvousView:
    return RendezvousView(state, frozenset(alive), joins, failures=failures or {},
                          coordinator=coordinator)


def _coordinate(v: RendezvousView, proven=frozenset(), now=NOW, last_call=20.0,
                memory: CoordinatorMemory | None = None):
    return decide_coordination(v, memory or CoordinatorMemory(), me="a", min_nodes=2, max_nodes=4,
                               last_call_timeout_s=last_call, now=now, proven_dead=proven)


def test_last_call_names_its_stragglers_for_probing():
    """WAIT in the last call lists the stragglers holding the round open (to be probed)."""
    a = _coordinate(_view(_open(4, ["a", "b", "c"]), {"a", "b", "c"}, {4: ["a", "b"]}))
    assert a.kind is ActionKind.WAIT and a.probe == ("c",) and a.until == NOW + 20.0


def test_straggler_proven_dead_does_not_hold_the_last_call():
    """The dead node's lease still runs, but a refused probe lets the round close now."""
    v = _view(_open(4, ["a", "b", "c"]), {"a", "b", "c"}, {4: ["a", "b"]})
    a = _coordinate(v, proven=frozenset({"c"}))
    assert a.kind is ActionKind.FINALIZE and a.members == ("a", "b")
    assert "c proven dead" in a.reason


def test_only_proven_stragglers_are_skipped():
    """A straggler not proven dead (a timeout, a frozen node) still holds the last call."""
    v = _view(_open(4, ["a", "b", "c", "d"]), {"a", "b", "c", "d"}, {4: ["a", "b"]})
    a = _coordinate(v, proven=frozenset({"c"}))
    assert a.kind is ActionKind.WAIT and a.probe == ("d",)


def test_proven_dead_does_not_lower_min_nodes():
    """Below min_nodes a proven-dead straggler changes nothing: the round waits."""
    v = _view(_open(4, ["a", "b"]), {"a", "b"}, {4: ["a"]})
    a = _coordinate(v, proven=frozenset({"b"}))
    assert a.kind is ActionKind.WAIT and "1/2" in a.reason


def test_proven_dead_joined_node_is_not_dropped_by_the_rule():
    """The rule only skips waiting: a joined node is admitted whatever a stale probe said
    (a live lease and a join key outweigh it; its agent restarted and rejoined)."""
    v = _view(_open(4, ["a", "b", "c"]), {"a", "b", "c"}, {4: ["a", "b", "c"]})
    a = _coordinate(v, proven=frozenset({"c"}))
    assert a.kind is ActionKind.FINALIZE and a.members == ("a", "b", "c")


def test_joined_coordinator_applies_the_same_rule():
    """decide_join (the coordinator's own join loop, full view) closes the round the same way."""
    v = _view(_open(4, ["a", "b", "c"]), {"a", "b", "c"}, {4: ["a", "b"]})
    a = decide_join(v, JoinProgress("a", 3, FAR), min_nodes=2, max_nodes=4,
                    last_call_timeout_s=20.0, now=NOW, proven_dead=frozenset({"c"}))
    assert a.kind is ActionKind.FINALIZE and a.members == ("a", "b")


def test_failure_with_a_member_proven_dead_is_membership():
    """A local failure while a member is proven dead spends no budget and waits for no lease."""
    v = RendezvousView(RoundState(3, "final", ["a", "b", "c"]), frozenset(), {}, full=False)
    assert attribute_failure(v, 3, "a")[0] is Attribution.UNDECIDED
    verdict, why = attribute_failure(v, 3, "a", proven_dead=frozenset({"c"}))
    assert verdict is Attribution.MEMBERSHIP and "c" in why and "proven dead" in why


def test_proven_dead_outside_the_round_is_ignored():
    """Only members of our round count (a dead stranger, or ourselves, changes nothing)."""
    v = RendezvousView(RoundState(3, "final", ["a", "b"]), frozenset(), {}, full=False)
    for proven in ({"z"}, {"a"}):
        assert attribute_failure(v, 3, "a", proven_dead=frozenset(proven))[0] is Attribution.UNDECIDED


def test_prober_remembers_dead_per_incarnation_and_reprobes_the_rest(monkeypatch):
    """Refused is kept per (node, incarnation); an answering peer is probed again when due."""
    answers = {("h", 1): True, ("h", 2): False}
    calls: list[tuple[str, int]] = []

    def fake_probe(host, port, timeout):
        calls.append((host, port))
        return answers[(host, port)]

    woke: list[int] = []
    p = PeerProber(on_dead=lambda: woke.append(1), probe_fn=fake_probe)
    monkeypatch.setattr("elasticd.rendezvous.liveness.threading.Thread",
                        lambda target, args, **kw: type("T", (), {"start": lambda self: target(*args)})())
    dead_c, alive_d = ProbeTarget("c", "h", 1, 7), ProbeTarget("d", "h", 2, 9)
    assert p.request([dead_c, alive_d], now=0.0) is None
    assert p.dead() == {"c": 7} and woke == [1]
    # d answered: not due again before REPROBE_S; c is never probed again.
    assert p.request([dead_c, alive_d], now=0.1) == 0.25
    assert p.request([dead_c, alive_d], now=0.3) is None
    assert calls == [("h", 1), ("h", 2), ("h", 2)]


def test_view_counts_a_proven_dead_node_only_while_its_record_is_that_incarnation():
    """A restarted agent (a new node record, a new port) is not dead because its old
    incarnation was; a record without a probe port is never a probe target."""
    from elasticd.etcd.kv import KV
    from elasticd.keys import JobKeys
    from elasticd.records import NodeRecord
    from elasticd.rendezvous.view import WatchedView

    k = JobKeys("j")
    v = WatchedView(k, "a")

    def rec(node, port, rev):
        r = NodeRecord(node=node, host="h", pid=1, version="0", started_at=0.0,
                       probe_host="10.0.0.9" if port else None, probe_port=port)
        return KV(k.node(node), r.to_json().encode(), rev, rev, 0)

    v.on_nodes_resync([rec("c", 4000, 7), rec("d", 0, 8)], 8)
    assert v.probe_targets(["c", "d", "gone"]) == [ProbeTarget("c", "10.0.0.9", 4000, 7)]
    assert v.proven_dead({"c": 7}) == frozenset({"c"})
    v.on_nodes_resync([rec("c", 4100, 12), rec("d", 0, 8)], 12)  # c's agent restarted
    assert v.proven_dead({"c": 7}) == frozenset()


def test_leaving_an_aborted_group_does_not_wait_out_the_pending_stop_flag(monkeypatch):
    """A survivor's pending should_stop all-reduce on the aborted group never completes (a
    peer is dead, and nothing wakes the wait): leaving waits 0.1 s for it, not 5 s (it
    added 5 s to one SIGKILL re-formation in three)."""
    from datetime import timedelta

    import elasticd.worker.context as wctx

    waited: list[timedelta] = []

    class StuckWork:
        def wait(self, timeout: timedelta) -> bool:
            waited.append(timeout)
            raise RuntimeError("timed out")

    from elasticd.worker import stop_agreement

    monkeypatch.setattr(wctx.dist, "is_initialized", lambda: False)
    runtime = wctx.WorkerRuntime()
    monkeypatch.setattr(wctx, "_RUNTIME", runtime)
    monkeypatch.setattr(stop_agreement.dist, "all_reduce", lambda *a, **k: StuckWork())
    runtime._stop.agree(local=False, draining=False)  # leaves the all-reduce pending, as should_stop does
    wctx.leave_group()
    assert waited == [timedelta(seconds=wctx.ABORTED_SETTLE_S)] and wctx.ABORTED_SETTLE_S <= 0.1
    wctx.leave_group()  # settled once: nothing is left pending
    assert len(waited) == 1
