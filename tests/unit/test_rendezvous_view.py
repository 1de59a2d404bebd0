"""Unit tests of the rendezvous handler's watched view (elasticd.rendezvous.view): what a
coordinator and a non-coordinator see, fed with watch events directly (no etcd)."""

from __future__ import annotations

from elasticd.etcd.kv import KV, WatchEvent
from elasticd.keys import JobKeys
from elasticd.records import AttributionRecord, RoundState, WaitingRecord
from elasticd.rendezvous.view import WatchedView

K = JobKeys("j")


def kv(key: str, value: str | bytes, rev: int) -> KV:
    return KV(key, value.encode() if isinstance(value, str) else value, rev, rev, 0)


def fed(node: str = "a") -> WatchedView:
    v = WatchedView(K, node)
    v.on_rdzv_resync([kv(K.rdzv_coordinator, "c", 2),
                      kv(K.rdzv_state, RoundState(4, "final", ["a", "b"], 1, 4).to_json(), 3)], 3)
    v.on_rdzv_hi_resync([kv(K.rdzv_waiting, WaitingRecord(5, ["d"]).to_json(), 4)], 4)
    return v


def test_partial_view_holds_own_joins_on_the_current_lease_and_announced_joiners():
    """A non-coordinator sees no liveness, its own joins only while on the lease they were
    put on, and the coordinator's announced joiners merged into the next round's joins."""
    v = fed("a")
    with v.cond:
        v.lease_id = 7
    v.add_own_join(5, 7)
    view, rev = v.snapshot()
    assert (view.full, view.coordinator, rev) == (False, "c", 3)
    assert view.alive == frozenset() and view.joins == {5: ["a", "d"]}
    assert view.announced == (5, ("d",))
    with v.cond:
        v.lease_id = 8  # re-registered: the old join died with the old lease
    assert v.snapshot()[0].joins == {5: ["d"]}


def test_full_view_has_nodes_and_joins_in_creation_order():
    """The coordinator's view (full) takes liveness and joins from its own watches, joins
    ordered by creation revision, not from announcements."""
    v = fed("c")
    v.on_nodes_resync([kv(K.node(n), "{}", 10 + i) for i, n in enumerate("abcd")], 20)
    v.on_joins_resync([kv(K.join(5, "d"), "1", 30), kv(K.join(5, "b"), "1", 21)], 30)
    v.set_full(True)
    view, _ = v.snapshot()
    assert view.full and view.alive == frozenset("abcd") and view.joins == {5: ["b", "d"]}
    v.on_nodes([WatchEvent(K.node("b"), None, 31)])
    assert "b" not in v.snapshot()[0].alive
    v.set_full(False)  # stepped down: the tables are dropped
    assert v.snapshot()[0].alive == frozenset()


def test_malformed_waiting_record_is_ignored():
    """rdzv/waiting that is not a valid record (or names an invalid node id) is not used."""
    v = fed("a")
    v.on_rdzv_hi([WatchEvent(K.rdzv_waiting, b'{"round": 5, "nodes": ["../x"]}', 9)])
    assert v.snapshot()[0].announced is None
    v.on_rdzv_hi([WatchEvent(K.rdzv_waiting, b"not json", 10)])
    assert v.snapshot()[0].announced is None


def test_full_view_holds_own_join_before_its_watch_event_then_in_creation_order():
    """The coordinator's own join counts as soon as its put returned (last, until the watch
    shows it, then by its revision): a lagging watch must not make it put the key again."""
    v = fed("c")
    with v.cond:
        v.lease_id = 7
    v.on_nodes_resync([kv(K.node(n), "{}", 10 + i) for i, n in enumerate("bcd")], 20)
    v.on_joins_resync([kv(K.join(5, "d"), "1", 30)], 30)
    v.set_full(True)
    v.add_own_join(5, 7)
    v.add_own_join(3, 7)  # a round before the state's (4): pruned, not a join
    assert v.snapshot()[0].joins == {5: ["d", "c"]}
    v.on_joins([WatchEvent(K.join(5, "c"), b"1", 25)])
    assert v.snapshot()[0].joins == {5: ["c", "d"]}
    with v.cond:
        v.lease_id = 8
    v.on_joins([WatchEvent(K.join(5, "c"), None, 40)])
    assert v.snapshot()[0].joins == {5: ["d"]}


def test_partial_view_has_own_failure_report_and_the_coordinators_verdict():
    """A partial view holds no one's failure report but its own (on its current lease)
    until the coordinator's verdict names every reporter in order; a malformed verdict is
    ignored."""
    v = fed("a")
    with v.cond:
        v.lease_id = 7
    v.add_own_failure(4, 7)
    view, _ = v.snapshot()
    assert view.failures == {4: ["a"]} and view.attributed is None
    v.on_rdzv([WatchEvent(K.rdzv_attribution, AttributionRecord(4, ["b", "a"]).to_json().encode(), 11)])
    view, _ = v.snapshot()
    assert view.failures == {4: ["b", "a"]} and view.attributed == 4
    v.on_rdzv([WatchEvent(K.rdzv_attribution, b'{"round": 4, "reporters": ["../x"]}', 12)])
    assert v.snapshot()[0].failures == {4: ["a"]}


def test_full_view_has_every_failure_report_in_creation_order():
    """The coordinator's view takes failure reports from its own watch, ordered by creation;
    its own report counts before the watch shows it."""
    v = fed("c")
    with v.cond:
        v.lease_id = 7
    v.on_failures_resync([kv(K.failure(4, "b"), "x", 40), kv(K.failure(4, "a"), "x", 30)], 40)
    v.set_full(True)
    v.add_own_failure(4, 7)
    assert v.snapshot()[0].failures == {4: ["a", "b", "c"]}
    v.on_failures([WatchEvent(K.failure(4, "c"), b"x", 20)])
    assert v.snapshot()[0].failures == {4: ["c", "a", "b"]}


def _parsed(view: WatchedView) -> tuple[frozenset[str], dict[int, list[str]], dict[int, list[str]]]:
    """What the full tables say, parsed from scratch (the view keeps indexes instead)."""
    from elasticd.keys import round_of_key

    def by_round(table: dict[str, KV], root: str) -> dict[int, list[str]]:
        out: dict[int, list[tuple[int, str]]] = {}
        for key, item in table.items():
            if (r := round_of_key(key, root)) is not None:
                out.setdefault(r, []).append((item.create_revision, key.rsplit("/", 1)[1]))
        return {r: [n for _, n in sorted(v)] for r, v in out.items()}

    alive = frozenset(key[len(K.nodes_prefix):] for key in view.nodes)
    return alive, by_round(view.joins, K.joins_root), by_round(view.failures, K.failures_root)


def test_full_view_indexes_follow_every_put_delete_and_resync():
    """The coordinator's snapshot reads liveness, joins and failures from indexes kept as
    events arrive: after any mix of puts, rewrites, deletes, resyncs and a step-down they
    say exactly what the tables say."""
    import random

    rng = random.Random(7)
    v = fed("c")
    v.set_full(True)
    names = [f"n{i}" for i in range(12)]
    rev = 100
    for step in range(600):
        rev += 1
        node, r = rng.choice(names), rng.randint(4, 7)
        table, key = rng.choice([(v.on_nodes, K.node(node)), (v.on_joins, K.join(r, node)),
                                 (v.on_failures, K.failure(r, node))])
        table([WatchEvent(key, None if rng.random() < 0.3 else b"1", rev)])
        if step % 97 == 0:  # a watch resynced: the table is replaced by a fresh read
            v.on_joins_resync([kv(k, "1", rev - i) for i, k in enumerate(list(v.joins)[:5])], rev)
        if step == 300:
            v.set_full(False)
            stepped_down = v.snapshot()[0]  # a partial view: only the announced joiner
            assert stepped_down.alive == frozenset() and stepped_down.joins == {5: ["d"]}
            v.set_full(True)
        view, _ = v.snapshot()
        alive, joins, failures = _parsed(v)
        assert view.alive == alive
        assert view.joins == joins
        assert view.failures == failures
    assert v.joins and v.failures and v.nodes  # the mix left something to compare
