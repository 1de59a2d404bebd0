"""Unit tests of the pure round protocol (elasticd.rendezvous.protocol), no etcd.

The last test runs several simulated nodes through ``decide_join`` against a shared
in-memory "etcd" (compare-and-swap on the state key, join keys in creation order, leases
as an alive set), in interleavings hypothesis picks, with stale views and node deaths.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from elasticd.records import RoundState
from elasticd.rendezvous.outage import loss_grace, may_resurrect, outage_window_s
from elasticd.rendezvous.protocol import (
    LEFT_DRAINED,
    LEFT_FINISHED,
    Action,
    ActionKind,
    Attribution,
    CoordinatorMemory,
    JoinProgress,
    MembershipChange,
    RendezvousView,
    Waiting,
    attribute_failure,
    decide_coordination,
    decide_join,
    dropped_members,
    early_join_round,
    nodes_waiting,
    order_members,
)

NOW = 100.0
FAR = 1e9


def view(state: RoundState | None, alive, joins=None, *, closed=False, failures=None,
         left=None) -> RendezvousView:
    return RendezvousView(state, frozenset(alive), joins or {}, closed, failures or {}, left or {})


def open_(r: int, members=()) -> RoundState:
    return RoundState(r, "open", list(members), 1, 4)


def final(r: int, members) -> RoundState:
    return RoundState(r, "final", list(members), 1, 4)


def decide(v: RendezvousView, me: str = "a", *, last_round=None, deadline=FAR, min_nodes=1,
           max_nodes=4, last_call=5.0, now=NOW, progress: JoinProgress | None = None,
           settle=0.0) -> Action:
    progress = progress or JoinProgress(me, last_round, deadline)
    return decide_join(v, progress, min_nodes=min_nodes, max_nodes=max_nodes,
                       last_call_timeout_s=last_call, now=now, start_settle_s=settle)


# --- decide_join: one decision at a time ------------------------------------------------


def test_no_state_opens_round_zero():
    """With no round state yet, the first step is to create round 0."""
    a = decide(view(None, {"a"}))
    assert (a.kind, a.round) == (ActionKind.INIT, 0)


def test_open_round_without_us_joins_it():
    """A node not yet joined to the open round joins that round."""
    a = decide(view(open_(3), {"a", "b"}, {3: ["b"]}))
    assert (a.kind, a.round) == (ActionKind.JOIN, 3)


def test_below_min_waits_until_deadline():
    """Fewer than min_nodes joined: wait (woken by changes, or at the join deadline)."""
    a = decide(view(open_(0), {"a", "b"}, {0: ["a"]}), min_nodes=2, deadline=500.0)
    assert a.kind is ActionKind.WAIT and a.until == 500.0
    assert "1/2" in a.reason


def test_max_nodes_joined_finalizes_in_join_order():
    """max_nodes joined: finalize at once, ranks in join order, extra joiners left out."""
    a = decide(view(open_(0), {"a", "b", "c", "d"}, {0: ["c", "a", "b", "d"]}), max_nodes=3)
    assert a.kind is ActionKind.FINALIZE
    assert a.members == ("c", "a", "b")
    assert "max_nodes=3" in a.reason


def test_all_live_nodes_joined_finalizes_without_last_call():
    """min reached and every live node joined: finalize now, no last-call wait."""
    a = decide(view(open_(0), {"a", "b"}, {0: ["b", "a"]}), min_nodes=2, max_nodes=4)
    assert a.kind is ActionKind.FINALIZE and a.members == ("b", "a")
    assert "all 2 live nodes joined" in a.reason


def test_last_call_waits_for_live_stragglers_then_finalizes():
    """min reached but a live node has not joined: wait for it until the last call, then go."""
    v = view(open_(0), {"a", "b", "c"}, {0: ["a", "b"]})
    progress = JoinProgress("a", None, FAR)
    first = decide(v, min_nodes=2, last_call=5.0, now=NOW, progress=progress)
    assert first.kind is ActionKind.WAIT and first.until == NOW + 5.0 and "c" in first.reason
    # The last call counts from when the minimum was first seen, not from each look.
    again = decide(v, min_nodes=2, last_call=5.0, now=NOW + 4.0, progress=progress)
    assert again.kind is ActionKind.WAIT and again.until == NOW + 5.0
    done = decide(v, min_nodes=2, last_call=5.0, now=NOW + 5.0, progress=progress)
    assert done.kind is ActionKind.FINALIZE and done.members == ("a", "b")
    assert "last call" in done.reason and "c" in done.reason


def test_first_round_settles_before_closing_below_max():
    """Regression (issue 25 item 2): the job's first round (no previous members) does not
    close the moment its only live node joined: it waits start_settle_s from the minimum,
    so a node started 0.4 s later (no lease yet) trains in it; then it closes."""
    v = view(open_(0), {"a"}, {0: ["a"]})
    mem = CoordinatorMemory()
    first = coordinate(replace(v, coordinator="a"), "a", memory=mem, start_settle_s=1.0)
    assert first.kind is ActionKind.WAIT and first.until == NOW + 1.0 and "settling" in first.reason
    v2 = view(open_(0), {"a", "b"}, {0: ["a", "b"]})
    joined = coordinate(replace(v2, coordinator="a"), "a", memory=mem, start_settle_s=1.0,
                        now=NOW + 0.5)
    assert joined.kind is ActionKind.WAIT and joined.until == NOW + 1.0
    done = coordinate(replace(v2, coordinator="a"), "a", memory=mem, start_settle_s=1.0,
                      now=NOW + 1.0)
    assert done.kind is ActionKind.FINALIZE and done.members == ("a", "b")
    # The same rule for a joined node with the full view.
    own = decide(v, min_nodes=1, settle=1.0)
    assert own.kind is ActionKind.WAIT and own.until == NOW + 1.0


def test_settle_applies_only_to_the_first_round_and_below_max():
    """A re-formation (the round carries previous members) closes at once when every live
    node joined, settle or not; max_nodes joined closes the first round at once too; a
    registered straggler holds the first round for max(last call, settle)."""
    again = decide(view(open_(3, ["a"]), {"a"}, {3: ["a"]}), settle=1.0)
    assert again.kind is ActionKind.FINALIZE
    full = decide(view(open_(0), {"a", "b"}, {0: ["a", "b"]}), max_nodes=2, settle=1.0)
    assert full.kind is ActionKind.FINALIZE and "max_nodes=2" in full.reason
    held = decide(view(open_(0), {"a", "b"}, {0: ["a"]}), last_call=0.5, settle=2.0)
    assert held.kind is ActionKind.WAIT and held.until == NOW + 2.0 and held.probe == ("b",)
    assert decide(view(open_(0), {"a"}, {0: ["a"]}), settle=0.0).kind is ActionKind.FINALIZE


def test_only_the_first_open_round_is_joined_before_the_agent_is_ready():
    """early_join_round: no round yet -> 0 (open it); the job's first round while open ->
    that round; a formed round or a re-formation (previous members) -> None."""
    assert early_join_round(None) == 0
    assert early_join_round(open_(0)) == 0
    assert early_join_round(open_(2)) == 2  # opened afresh, nobody trained (e.g. a restart)
    assert early_join_round(final(0, ["a"])) is None
    assert early_join_round(open_(1, ["a"])) is None


def test_last_call_wait_is_capped_by_join_deadline():
    """A last call that would end after join_timeout wakes at the join deadline instead."""
    v = view(open_(0), {"a", "b", "c"}, {0: ["a", "b"]})
    a = decide(v, min_nodes=2, last_call=50.0, deadline=NOW + 3.0)
    assert a.kind is ActionKind.WAIT and a.until == NOW + 3.0


def test_dead_joiners_do_not_count():
    """A join key whose node has no live lease does not count toward min or max."""
    v = view(open_(0), {"a"}, {0: ["a", "ghost"]})
    a = decide(v, min_nodes=2, max_nodes=2)
    assert a.kind is ActionKind.WAIT
    b = decide(v, min_nodes=1, max_nodes=2)
    assert b.kind is ActionKind.FINALIZE and b.members == ("a",)


def test_member_of_final_round_is_done():
    """A member of the final round that has not used it yet is done, with the rank table."""
    a = decide(view(final(2, ["b", "a"]), {"a", "b"}), last_round=1)
    assert (a.kind, a.round, a.members) == (ActionKind.DONE, 2, ("b", "a"))


def test_used_round_opens_next():
    """Calling next_rendezvous again after using round r opens round r+1 (re-rendezvous)."""
    a = decide(view(final(2, ["a", "b"]), {"a", "b"}), last_round=2)
    assert (a.kind, a.round) == (ActionKind.OPEN_NEXT, 3)
    assert "re-rendezvous" in a.reason


def test_lost_member_opens_next_round():
    """A member of the final round without a live lease makes any node open the next round."""
    a = decide(view(final(4, ["a", "b", "c"]), {"a", "c"}), me="d")
    assert (a.kind, a.round) == (ActionKind.OPEN_NEXT, 5)
    assert "lost b" in a.reason


def test_late_arrival_preregisters_for_next_round():
    """A node arriving after the round is final joins round r+1 and then waits to be admitted."""
    v = view(final(1, ["a", "b"]), {"a", "b", "c"})
    a = decide(v, me="c")
    assert (a.kind, a.round) == (ActionKind.JOIN, 2)
    v2 = view(final(1, ["a", "b"]), {"a", "b", "c"}, {2: ["c"]})
    b = decide(v2, me="c", deadline=700.0)
    assert (b.kind, b.round, b.until) == (ActionKind.WAIT, 2, 700.0)


def test_closed_wins_over_everything():
    """A closed job answers CLOSED, even past the join deadline."""
    a = decide(view(final(1, ["a"]), {"a"}, closed=True), deadline=0.0)
    assert a.kind is ActionKind.CLOSED


def test_join_deadline_times_out():
    """Past join_timeout (and not closed) the answer is TIMEOUT."""
    a = decide(view(open_(0), {"a", "b"}, {0: ["a"]}), min_nodes=2, deadline=NOW)
    assert a.kind is ActionKind.TIMEOUT


# --- ranks ------------------------------------------------------------------------------


def test_order_members_keeps_previous_relative_order_then_newcomers():
    """Previous members keep their relative order (dense ranks), newcomers follow in join order."""
    assert order_members(["b", "a", "c"], ["c", "d", "a", "e"], 10) == ("a", "c", "d", "e")


def test_order_members_truncates_to_max():
    """At most max_nodes are admitted; previous members are admitted first."""
    assert order_members(["x", "y"], ["n1", "y", "n2", "x"], 3) == ("x", "y", "n1")


def test_next_round_after_lost_member_keeps_survivor_order():
    """After a member is lost, the survivors' ranks stay in the same relative order (dense)."""
    state = open_(5, members=["a", "b", "c", "d"])
    a = decide(view(state, {"a", "c", "d"}, {5: ["d", "c", "a"]}), me="a", min_nodes=1, max_nodes=4)
    assert a.kind is ActionKind.FINALIZE
    assert a.members == ("a", "c", "d")


# --- nodes_waiting ----------------------------------------------------------------------


def test_nodes_waiting_zero_without_state_or_when_closed():
    """No round state, or a closed job: nobody waits."""
    assert nodes_waiting(view(None, {"a"}), 0, max_nodes=4).count == 0
    assert nodes_waiting(view(final(0, ["a"]), {"a", "b"}, {1: ["b"]}, closed=True), 0, max_nodes=4).count == 0


def test_nodes_waiting_counts_newer_round():
    """A round newer than ours (opened by someone else) means re-rendezvous."""
    w = nodes_waiting(view(open_(3), {"a"}), 2, max_nodes=4)
    assert w.count == 1 and "round 3" in w.reason
    assert w.kind is MembershipChange.NEWER_ROUND


def test_nodes_waiting_counts_lost_members():
    """Members of our final round without a live lease are counted, and named."""
    w = nodes_waiting(view(final(2, ["a", "b", "c"]), {"a"}), 2, max_nodes=4)
    assert w.count == 2 and "b" in w.reason and "c" in w.reason
    assert w.kind is MembershipChange.MEMBER_LOST


def test_nodes_waiting_counts_live_late_joiners_while_there_is_room():
    """Live, non-member joiners of round r+1 count while the round has room for them."""
    v = view(final(2, ["a", "b"]), {"a", "b", "c", "d"}, {3: ["c", "ghost", "d", "a"]})
    w = nodes_waiting(v, 2, max_nodes=4)
    assert w.count == 2 and "c" in w.reason and "d" in w.reason
    assert w.kind is MembershipChange.JOIN
    assert nodes_waiting(v, 2, max_nodes=2).count == 0, "a full round has no room"


def test_nodes_waiting_zero_in_steady_state():
    """Our final round with every member alive and no joiners: nothing waits."""
    assert nodes_waiting(view(final(2, ["a", "b"]), {"a", "b"}), 2, max_nodes=4) == Waiting()


def test_finished_member_is_no_membership_change():
    """Regression (torch's workers_drift_fail): a member that finished and revoked its lease
    is not a lost member: the slower node keeps its healthy workers (nothing waits)."""
    v = view(final(2, ["a", "b"]), {"a"}, {3: ["c"]}, left={2: {"b": LEFT_FINISHED}})
    assert nodes_waiting(v, 2, max_nodes=4) == Waiting()


def test_drained_member_is_a_leave_not_a_loss():
    """A member that drained and left is a membership change of kind MEMBER_LEFT."""
    v = view(final(2, ["a", "b"]), {"a"}, left={2: {"b": LEFT_DRAINED}})
    w = nodes_waiting(v, 2, max_nodes=4)
    assert (w.count, w.kind) == (1, MembershipChange.MEMBER_LEFT) and "left: b" in w.reason


def test_leave_marker_of_another_round_does_not_excuse_a_loss():
    """A clean-leave marker counts only for the round it names."""
    v = view(final(3, ["a", "b"]), {"a"}, left={2: {"b": LEFT_FINISHED}})
    assert nodes_waiting(v, 3, max_nodes=4).kind is MembershipChange.MEMBER_LOST


def test_lost_wins_over_finished():
    """A crashed member is still a loss even when another member finished."""
    v = view(final(2, ["a", "b", "c"]), {"a"}, left={2: {"b": LEFT_FINISHED}})
    w = nodes_waiting(v, 2, max_nodes=4)
    assert w.kind is MembershipChange.MEMBER_LOST and w.reason == "members lost: c"


def test_finished_job_does_not_reform():
    """A node that would open the next round after a member finished reads the job as
    closed instead: a finished job never re-forms."""
    v = view(final(2, ["a", "b"]), {"a"}, left={2: {"b": LEFT_FINISHED}})
    a = decide(v, "a", last_round=2)
    assert a.kind is ActionKind.CLOSED and "b completed" in a.reason


def test_drained_member_opens_next_round_for_late_arrival():
    """A member that drained opens the next round like a lost one (the job goes on)."""
    v = view(final(2, ["a", "b"]), {"a", "c"}, left={2: {"b": LEFT_DRAINED}})
    a = decide(v, "c")
    assert a.kind is ActionKind.OPEN_NEXT and "b left round 2" in a.reason


def test_member_back_after_its_own_leave_opens_a_new_round():
    """A new agent of a member that left final round r cleanly (drain, `elasticd stop`)
    never re-enters r: it opens r+1, with no cause naming itself (issue 26: it trained
    alone in the stopped round until the next arrival superseded it)."""
    alone = final(4, ["b"])
    for v in (view(alone, {"b"}, left={4: {"b": LEFT_DRAINED}}),
              partial(alone, left={4: {"b": LEFT_DRAINED}})):
        a = decide(v, "b")
        assert (a.kind, a.round, a.cause, a.changed) == (ActionKind.OPEN_NEXT, 5, "", ()), a
        assert "round 4 ended when b left it" in a.reason
    # Both stopped together: the one back first opens r+1; the other is reported as left.
    both = view(final(4, ["a", "b"]), {"b"}, left={4: {"a": LEFT_DRAINED, "b": LEFT_DRAINED}})
    a = decide(both, "b")
    assert (a.kind, a.round, a.cause, a.changed) == (ActionKind.OPEN_NEXT, 5, "member_left", ("a",))
    # A leave recorded in another round, or a peer's leave, does not retire ours.
    assert decide(view(alone, {"b"}, left={3: {"b": LEFT_DRAINED}}), "b").kind is ActionKind.DONE
    assert decide(view(final(4, ["a", "b"]), {"a", "b"}, left={4: {"c": LEFT_DRAINED}}),
                  "b").kind is ActionKind.DONE


def test_a_loss_right_after_an_etcd_outage_opens_no_round_during_the_grace():
    """A node in rendezvous (a joiner with the full view) that sees a member lost while
    the outage grace runs waits for it to re-register instead of opening the next round;
    once the grace passed, the loss opens it (the soak: the joiner trained from the
    checkpoint beside the member that re-registered and trained on in the old round)."""
    v = view(final(4, ["a"]), {"c"}, {5: ["c"]})
    held = decide_join(v, JoinProgress("c", None, FAR), min_nodes=1, max_nodes=4,
                       last_call_timeout_s=5.0, now=NOW, defer_lost_until=NOW + 3.0)
    assert (held.kind, held.until) == (ActionKind.WAIT, NOW + 3.0) and "re-register" in held.reason
    after = decide_join(v, JoinProgress("c", None, FAR), min_nodes=1, max_nodes=4,
                        last_call_timeout_s=5.0, now=NOW + 3.0, defer_lost_until=NOW + 3.0)
    assert (after.kind, after.round, after.cause) == (ActionKind.OPEN_NEXT, 5, "member_lost")


# --- attribute_failure ------------------------------------------------------------------


def test_failure_with_lost_peer_is_membership():
    """A worker failure while a peer's lease is gone is a membership change, not our fault."""
    v = view(final(1, ["a", "b"]), {"a"}, failures={1: ["a"]})
    assert attribute_failure(v, 1, "a")[0] is Attribution.MEMBERSHIP


def test_failure_after_peer_left_cleanly_is_membership():
    """A worker failure after a peer drained (or finished) and left is not our fault."""
    for kind in (LEFT_DRAINED, LEFT_FINISHED):
        v = view(final(1, ["a", "b"]), {"a"}, failures={1: ["a"]}, left={1: {"b": kind}})
        assert attribute_failure(v, 1, "a")[0] is Attribution.MEMBERSHIP


def test_failure_after_newer_round_is_membership():
    """A failure when a newer round exists is a membership change."""
    assert attribute_failure(view(open_(2, ["a", "b"]), {"a", "b"}), 1, "a")[0] is Attribution.MEMBERSHIP


def test_first_reporter_is_root_others_are_victims():
    """When every member reported, the first reporter is the root cause, the rest victims."""
    v = view(final(1, ["a", "b", "c"]), {"a", "b", "c"}, failures={1: ["b", "a", "c"]})
    assert attribute_failure(v, 1, "b")[0] is Attribution.ROOT
    verdict, why = attribute_failure(v, 1, "a")
    assert verdict is Attribution.VICTIM and "b" in why


def test_partial_reports_are_undecided():
    """Until every live member reported (us included), the verdict is undecided."""
    v = view(final(1, ["a", "b", "c"]), {"a", "b", "c"}, failures={1: ["a", "b"]})
    assert attribute_failure(v, 1, "a")[0] is Attribution.UNDECIDED
    assert attribute_failure(view(final(1, ["a", "b"]), {"a", "b"}, failures={1: ["b"]}), 1, "a")[0] is Attribution.UNDECIDED
    assert attribute_failure(view(None, {"a"}), 1, "a")[0] is Attribution.UNDECIDED


# --- etcd outages: loss grace, resurrect eligibility -------------------------------------


def test_loss_after_etcd_trouble_is_held_for_ttl_plus_two():
    """Members lost right after etcd trouble are held back for node_ttl_s + 2 s from first sight."""
    g = loss_grace(["b"], etcd_trouble=True, loss_seen_at=None, now=NOW, node_ttl_s=5)
    assert g.hold and g.loss_seen_at == NOW and "b" in g.reason
    g = loss_grace(["b"], etcd_trouble=True, loss_seen_at=g.loss_seen_at, now=NOW + 6.9, node_ttl_s=5)
    assert g.hold and g.loss_seen_at == NOW
    g = loss_grace(["b"], etcd_trouble=True, loss_seen_at=g.loss_seen_at, now=NOW + 7.0, node_ttl_s=5)
    assert not g.hold and g.loss_seen_at == NOW  # grace over: the loss counts


def test_loss_grace_restarts_while_etcd_is_still_in_trouble():
    """A second etcd freeze inside the grace does not eat it: the lost members need
    node_ttl_s + 2 s of etcd answering to re-register (soak seed 880009)."""
    g = loss_grace(["b"], etcd_trouble=True, loss_seen_at=None, now=NOW, node_ttl_s=2)
    # etcd froze again 0.7 s later and is still failing calls 4.2 s after first sight
    g = loss_grace(["b"], etcd_trouble=True, loss_seen_at=g.loss_seen_at, now=NOW + 4.3,
                   node_ttl_s=2, trouble_at=NOW + 4.2)
    assert g.hold and g.loss_seen_at == NOW
    assert loss_grace(["b"], etcd_trouble=True, loss_seen_at=NOW, now=NOW + 8.3, node_ttl_s=2,
                      trouble_at=NOW + 4.2).hold is False


def test_loss_without_etcd_trouble_counts_at_once():
    """A member lost while etcd was fine is a membership change at once (no grace)."""
    g = loss_grace(["b"], etcd_trouble=False, loss_seen_at=None, now=NOW, node_ttl_s=5)
    assert not g.hold and g.loss_seen_at is None
    # a loss first seen during trouble keeps its first sight while trouble fades
    assert loss_grace(["b"], etcd_trouble=False, loss_seen_at=NOW - 1, now=NOW,
                      node_ttl_s=5).loss_seen_at == NOW - 1


def test_loss_grace_memory_resets_once_nobody_is_lost():
    """Once every member is back, the next loss gets a fresh grace period."""
    g = loss_grace([], etcd_trouble=True, loss_seen_at=NOW - 100, now=NOW, node_ttl_s=5)
    assert not g.hold and g.loss_seen_at is None
    assert loss_grace(["b"], etcd_trouble=True, loss_seen_at=g.loss_seen_at, now=NOW,
                      node_ttl_s=5).hold


def test_outage_window_is_ttl_plus_five():
    """etcd trouble explains an expired lease for node_ttl_s + 5 s."""
    assert outage_window_s(5) == 10.0


def test_resurrect_only_after_etcd_trouble_while_no_round_formed_without_us():
    """A node re-registers only if etcd was away and the job is still in its final round,
    or the next round is open with it among the previous members (soak seed 74015)."""
    state = final(3, ["a", "b"])
    assert may_resurrect(state, 3, "a", lease_lost=True, etcd_trouble=True)[0]
    assert not may_resurrect(state, 3, "a", lease_lost=True, etcd_trouble=False)[0]  # we were away
    assert not may_resurrect(state, 3, "a", lease_lost=False, etcd_trouble=True)[0]  # lease alive
    assert not may_resurrect(state, None, "a", lease_lost=True, etcd_trouble=True)[0]  # no round yet
    assert not may_resurrect(final(4, ["a", "b"]), 3, "a", lease_lost=True, etcd_trouble=True)[0]
    assert may_resurrect(open_(4, ["a", "b"]), 3, "a", lease_lost=True, etcd_trouble=True)[0]
    assert not may_resurrect(open_(4, ["a", "b"]), 3, "a", lease_lost=True, etcd_trouble=False)[0]
    assert not may_resurrect(open_(4, ["b"]), 3, "a", lease_lost=True, etcd_trouble=True)[0]
    assert not may_resurrect(open_(5, ["a", "b"]), 3, "a", lease_lost=True, etcd_trouble=True)[0]
    assert not may_resurrect(open_(3, ["a", "b"]), 3, "a", lease_lost=True, etcd_trouble=True)[0]
    assert not may_resurrect(final(3, ["b"]), 3, "a", lease_lost=True, etcd_trouble=True)[0]
    assert not may_resurrect(None, 3, "a", lease_lost=True, etcd_trouble=True)[0]



# --- simulation: many nodes, one CAS store, random interleavings ------------------------


@dataclass
class FakeEtcd:
    """The rendezvous keys of one job, with etcd's semantics where the protocol relies on them."""

    min_nodes: int
    max_nodes: int
    revision: int = 0
    state: RoundState | None = None
    state_rev: int = 0
    joins: dict[int, list[str]] = field(default_factory=dict)  # creation order
    alive: set[str] = field(default_factory=set)
    finals: dict[int, tuple[str, ...]] = field(default_factory=dict)  # every finalized round
    history: list[tuple[RendezvousView, int]] = field(default_factory=list)
    coordinated: bool = False  # one coordinator (the smallest live name) with the full view
    announced: tuple[int, tuple[str, ...]] | None = None  # rdzv/waiting

    def commit(self) -> None:
        self.revision += 1
        joins = {r: tuple(ns) for r, ns in self.joins.items()}
        self.history.append((RendezvousView(self.state, frozenset(self.alive), joins,
                                            announced=self.announced), self.state_rev))

    def put_state_if(self, state: RoundState, expected_rev: int) -> bool:
        if self.state_rev != expected_rev:
            return False
        self.state = state
        self.state_rev = self.revision + 1
        if state.phase == "final":
            assert state.round not in self.finals, f"round {state.round} finalized twice"
            self.finals[state.round] = tuple(state.members)
        self.commit()
        return True


@dataclass
class SimNode:
    name: str
    progress: JoinProgress
    seen: int = 0  # index into FakeEtcd.history: this node's (lagging) watch view
    done: Action | None = None
    waiting_until: float | None = None
    arrived: bool = False
    dead: bool = False
    memory: CoordinatorMemory = field(default_factory=CoordinatorMemory)
    duty_until: float | None = None


def as_seen_by(etcd: FakeEtcd, node: SimNode, v: RendezvousView) -> RendezvousView:
    """The view a node of a coordinated job has: full for the coordinator, else partial
    (no liveness, only its own joins), as the handler builds it."""
    if not etcd.coordinated:
        return v
    coordinator = min(v.alive) if v.alive else None
    if node.name == coordinator:
        return replace(v, coordinator=coordinator)
    own = {r: [node.name] for r, ns in v.joins.items() if node.name in ns}
    if v.announced is not None:  # the handler merges rdzv/waiting into a partial view's joins
        r, waiting = v.announced
        own[r] = [*own.get(r, []), *(n for n in waiting if n != node.name)]
    return replace(v, alive=frozenset(), joins=own, full=False, coordinator=coordinator)


def open_next(etcd: FakeEtcd, v: RendezvousView, a: Action, state_rev: int) -> bool:
    """CAS final(r) -> open(r+1) with the action's cause, then the opener's GC of old joins."""
    assert v.state is not None
    ok = etcd.put_state_if(RoundState(a.round, "open", list(v.state.members), etcd.min_nodes,
                                      etcd.max_nodes, cause=a.cause, changed=list(a.changed)),
                           state_rev)
    if ok:
        for r in [r for r in etcd.joins if r < a.round]:
            del etcd.joins[r]
        etcd.commit()
    return ok


def step(etcd: FakeEtcd, node: SimNode, now: float, *, last_call_s: float) -> bool:
    """One look-and-act of one node, as the handler does it. Returns True if it changed anything."""
    full, state_rev = etcd.history[node.seen]
    v = as_seen_by(etcd, node, full)
    node.duty_until = None
    if v.full and v.coordinator == node.name:  # the coordinator's duty (its own thread)
        duty = decide_coordination(v, node.memory, me=node.name, min_nodes=etcd.min_nodes,
                                   max_nodes=etcd.max_nodes, last_call_timeout_s=last_call_s, now=now)
        if duty.kind is ActionKind.FINALIZE:
            assert v.state is not None
            if etcd.put_state_if(replace(v.state, phase="final", members=list(duty.members)), state_rev):
                return True
        elif duty.kind is ActionKind.OPEN_NEXT:
            if open_next(etcd, v, duty, state_rev):
                return True
        elif duty.kind is ActionKind.ANNOUNCE:
            if etcd.announced != (duty.round, duty.members):
                etcd.announced = (duty.round, duty.members)
                etcd.commit()
                return True
        elif duty.kind is ActionKind.WAIT:
            node.duty_until = duty.until
    if node.done is not None:
        # The agent's loop: re-rendezvous when someone waits (torch's num_nodes_waiting path).
        if nodes_waiting(v, node.done.round, max_nodes=etcd.max_nodes).count == 0:
            return False
        node.progress = JoinProgress(node.name, node.done.round, FAR)
        node.done = None
        return True
    a = decide_join(v, node.progress, min_nodes=etcd.min_nodes, max_nodes=etcd.max_nodes,
                    last_call_timeout_s=last_call_s, now=now)
    node.waiting_until = None
    if a.kind is ActionKind.DONE:
        node.done = a
        return True
    if a.kind is ActionKind.WAIT:
        node.waiting_until = a.until
        return False
    assert a.kind not in (ActionKind.CLOSED, ActionKind.TIMEOUT), a
    if a.kind is ActionKind.INIT:
        return etcd.put_state_if(RoundState(0, "open", [], etcd.min_nodes, etcd.max_nodes), 0)
    if a.kind is ActionKind.OPEN_NEXT:
        return open_next(etcd, v, a, state_rev)
    if a.kind is ActionKind.JOIN:
        joined = etcd.joins.setdefault(a.round, [])
        if node.name in joined:
            return False
        joined.append(node.name)
        etcd.commit()
        return True
    if a.kind is ActionKind.FINALIZE:
        assert v.state is not None
        return etcd.put_state_if(replace(v.state, phase="final", members=list(a.members)), state_rev)
    raise AssertionError(f"unexpected action {a}")


def kill(etcd: FakeEtcd, node: SimNode) -> None:
    """Lease expiry: the node key and every join key on the lease vanish."""
    node.dead = True
    etcd.alive.discard(node.name)
    for joined in etcd.joins.values():
        if node.name in joined:
            joined.remove(node.name)
    etcd.commit()


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("act"), st.integers(0, 7), st.integers(0, 6)),  # node, view lag
        st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0, 6.0]), st.just(0)),
        st.tuples(st.just("arrive"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("kill"), st.integers(0, 7), st.just(0)),
    ),
    min_size=10,
    max_size=200,
)


def arrive(etcd: FakeEtcd, node: SimNode) -> None:
    """A node starts: it registers its lease (node key) before it looks at the round."""
    node.arrived = True
    etcd.alive.add(node.name)
    etcd.commit()
    node.seen = len(etcd.history) - 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_nodes=st.integers(1, 6), min_nodes=st.integers(1, 6), extra=st.integers(0, 2),
       late=st.lists(st.booleans(), min_size=6, max_size=6), ops=_OPS,
       last_call_s=st.sampled_from([0.5, 5.0]), coordinated=st.booleans())
def test_random_interleavings_converge_to_one_final_round(n_nodes, min_nodes, extra, late, ops,
                                                          last_call_s, coordinated):
    """Nodes racing through decide_join with stale views, late starts, delays and deaths all
    end in the same final round with the same members: ranks dense 0..n-1, min<=n<=max,
    every live node admitted while there is room, rank order stable from round to round;
    also when only a coordinator sees liveness and joins (partial views for the others)."""
    min_nodes = min(min_nodes, n_nodes)
    max_nodes = max(min_nodes, n_nodes - 1 + extra)  # sometimes fewer slots than nodes
    etcd = FakeEtcd(min_nodes, max_nodes, coordinated=coordinated)
    nodes = [SimNode(f"n{i}", JoinProgress(f"n{i}", None, FAR)) for i in range(n_nodes)]
    etcd.commit()
    for node, is_late in zip(nodes, late, strict=False):
        if not is_late:
            arrive(etcd, node)
    now = 0.0

    # Phase 1: an adversarial schedule (hypothesis) with lagging views, delays, arrivals, deaths.
    for kind, idx, arg in ops:
        if kind == "tick":
            now += arg
            continue
        node = nodes[idx % n_nodes]
        if node.dead:
            continue
        if kind == "arrive":
            if not node.arrived:
                arrive(etcd, node)
            continue
        if not node.arrived:
            continue
        if kind == "kill":
            if len([n for n in nodes if n.arrived and not n.dead]) > min_nodes:
                kill(etcd, node)
            continue
        latest = len(etcd.history) - 1
        node.seen = max(node.seen, latest - arg)  # watch views lag but never go back
        step(etcd, node, now, last_call_s=last_call_s)
    for node in nodes:  # the stragglers start now
        if not node.arrived:
            arrive(etcd, node)

    # Phase 2: a fair schedule with up-to-date views until nothing changes.
    for _ in range(2000):
        live = [n for n in nodes if not n.dead]
        changed = False
        for node in live:
            node.seen = len(etcd.history) - 1
            changed |= step(etcd, node, now, last_call_s=last_call_s)
        if changed:
            continue
        wakeups = [t for n in live for t in (n.waiting_until, n.duty_until) if t is not None and t < FAR]
        if wakeups and min(wakeups) > now:
            now = min(wakeups)
            continue
        if wakeups:
            raise AssertionError(f"livelock: waiting nodes with due wake-ups {wakeups} at {now}")
        break
    else:
        raise AssertionError("the protocol did not converge in 2000 fair passes")

    live = [n for n in nodes if not n.dead]
    event(f"final rounds: {min(len(etcd.finals), 3)}{'+' if len(etcd.finals) > 3 else ''}")
    event(f"nodes lost: {n_nodes - len(live)}")
    target(float(len(etcd.finals)), label="rounds finalized")
    state = etcd.state
    assert state is not None and state.phase == "final", f"ended in {state}"
    members = tuple(state.members)
    done = [n for n in live if n.done is not None]
    assert {n.name for n in done} == set(members), "DONE nodes differ from the final members"
    for n in done:
        assert n.done.round == state.round and n.done.members == members
    assert len(set(members)) == len(members), "a node holds two ranks"
    assert min_nodes <= len(members) <= max_nodes
    assert len(members) == min(len(live), max_nodes), "a live node was left out while there was room"
    assert set(members) <= {n.name for n in live}
    waiting = [n for n in live if n.done is None]
    assert all(n.waiting_until is not None for n in waiting)
    # Stable ranks: survivors of round r keep their relative order, ahead of newcomers.
    rounds = sorted(etcd.finals)
    for prev, cur in zip(rounds, rounds[1:], strict=False):
        before, after = etcd.finals[prev], etcd.finals[cur]
        kept = [m for m in before if m in after]
        assert list(after[: len(kept)]) == kept, f"round {prev} {before} -> round {cur} {after}"


@pytest.mark.parametrize("coordinated", [False, True])
@pytest.mark.parametrize("n_nodes", [1, 3, 5])
def test_simultaneous_start_finalizes_in_one_round(n_nodes, coordinated):
    """Nodes that start together with fresh views form round 0 with everyone, no extra rounds
    (also with a coordinator closing the round for nodes with partial views)."""
    etcd = FakeEtcd(1, 8, coordinated=coordinated)
    nodes = [SimNode(f"n{i}", JoinProgress(f"n{i}", None, FAR)) for i in range(n_nodes)]
    etcd.commit()
    for node in nodes:
        arrive(etcd, node)
    for _ in range(20):
        for node in nodes:
            node.seen = len(etcd.history) - 1
            step(etcd, node, 0.0, last_call_s=1.0)
    assert etcd.state is not None and etcd.state.round == 0 and etcd.state.phase == "final"
    assert sorted(etcd.state.members) == sorted(n.name for n in nodes)
    assert all(n.done is not None and n.done.round == 0 for n in nodes)


# --- partial views and the coordinator (watch fan-out O(N)) ------------------------------


def partial(state, joins=None, *, left=None, coordinator="c") -> RendezvousView:
    return RendezvousView(state, frozenset(), joins or {}, False, {}, left or {},
                          coordinator=coordinator, full=False)


def coordinate(v: RendezvousView, me: str = "c", *, memory=None, min_nodes=1, max_nodes=4,
               last_call=5.0, now=NOW, defer_until=None, start_settle_s=0.0,
               finishing=False, hold_until=None) -> Action:
    return decide_coordination(v, memory or CoordinatorMemory(), me=me, min_nodes=min_nodes,
                               max_nodes=max_nodes, last_call_timeout_s=last_call, now=now,
                               defer_lost_until=defer_until, start_settle_s=start_settle_s,
                               finishing=finishing, hold_previous_until=hold_until)


def test_after_etcd_trouble_the_last_call_waits_for_previous_members():
    """Soak seed 74018: a node that joined during an etcd outage coordinated and closed the
    open round a second after etcd came back, without the member of the previous round
    that had trained on (it was still reconnecting); it trained alone from an older
    checkpoint. After etcd trouble (``hold_until``) a previous member holds the last call
    until then; a newcomer straggler does not; without trouble the last call is as before."""
    v = replace(view(open_(8, ["n3", "n4"]), {"n3", "n7", "n9"}, {8: ["n7"]}), coordinator="n7")
    mem = CoordinatorMemory()
    held = coordinate(v, "n7", memory=mem, last_call=1.0, hold_until=NOW + 4.0)
    assert held.kind is ActionKind.WAIT and held.until == NOW + 4.0
    assert "previous round after etcd trouble: n3" in held.reason and "n3" in held.probe
    still = coordinate(v, "n7", memory=mem, last_call=1.0, now=NOW + 2.0, hold_until=NOW + 4.0)
    assert still.kind is ActionKind.WAIT
    done = coordinate(v, "n7", memory=mem, last_call=1.0, now=NOW + 4.0, hold_until=NOW + 4.0)
    assert done.kind is ActionKind.FINALIZE and done.members == ("n7",)
    # No trouble: the last call alone, as before.
    plain = coordinate(v, "n7", memory=CoordinatorMemory(), last_call=1.0, now=NOW)
    assert plain.kind is ActionKind.WAIT and plain.until == NOW + 1.0
    # Only newcomers missing (n9, not a member of round 7): the hold does not apply.
    joiners = replace(view(open_(8, ["n3"]), {"n3", "n7", "n9"}, {8: ["n7", "n3"]}),
                      coordinator="n7")
    quick = coordinate(joiners, "n7", memory=CoordinatorMemory(), last_call=1.0,
                       hold_until=NOW + 4.0)
    assert quick.kind is ActionKind.WAIT and quick.until == NOW + 1.0
    # Seed 74023: the previous members' leases expired with the outage (not alive): all
    # the live nodes joined, yet the round waits for them; one that left cleanly does not hold.
    lost = replace(view(open_(6, ["n1", "n3", "n0"]), {"n4"}, {6: ["n4"]},
                        left={5: {"n1": LEFT_DRAINED}}), coordinator="n4")
    wait = coordinate(lost, "n4", memory=CoordinatorMemory(), last_call=1.0, hold_until=NOW + 4.0)
    assert wait.kind is ActionKind.WAIT and wait.until == NOW + 4.0
    assert "waiting for n3,n0 of the previous round" in wait.reason
    after = coordinate(lost, "n4", memory=CoordinatorMemory(), last_call=1.0, now=NOW + 4.0,
                       hold_until=NOW + 4.0)
    assert after.kind is ActionKind.FINALIZE and after.members == ("n4",)
    assert coordinate(lost, "n4", memory=CoordinatorMemory(), last_call=1.0).kind is ActionKind.FINALIZE
    # The coordinator's own join path decides the same (decide_join with the full view).
    own = decide_join(v, JoinProgress("n7", None, FAR), min_nodes=1, max_nodes=4,
                      last_call_timeout_s=1.0, now=NOW + 2.0, hold_previous_until=NOW + 4.0)
    assert own.kind is ActionKind.WAIT and own.until == NOW + 4.0


def test_partial_view_never_closes_a_round_itself():
    """A node without the full view that joined an open round waits for the coordinator,
    even when its (empty) liveness would make it look complete."""
    a = decide(partial(open_(0), {0: ["a"]}), min_nodes=1)
    assert a.kind is ActionKind.WAIT and "coordinator (c)" in a.reason and a.until == FAR


def test_partial_view_sees_drained_members_but_not_losses():
    """Without liveness a member of the final round sees clean leaves (left/ keys) but
    treats members with no marker as present: losses come from the coordinator."""
    v = partial(final(4, ["a", "b", "d"]), left={4: {"d": LEFT_DRAINED}})
    assert nodes_waiting(v, 4, max_nodes=4).kind is MembershipChange.MEMBER_LEFT
    assert nodes_waiting(partial(final(4, ["a", "b"])), 4, max_nodes=4).count == 0
    assert decide(partial(final(4, ["a", "b"])), last_round=3).kind is ActionKind.DONE


def test_round_opened_for_a_cause_is_reported_with_that_kind():
    """A round the coordinator opened for a loss (cause and nodes in the state key) is
    reported to members of the previous round as MEMBER_LOST with those nodes, not as a
    bare newer round; a round two ahead, or opened without a cause, is NEWER_ROUND."""
    lost = RoundState(5, "open", ["a", "b"], 1, 4, cause="member_lost", changed=["b"])
    w = nodes_waiting(partial(lost), 4, max_nodes=4)
    assert (w.count, w.kind, w.nodes) == (1, MembershipChange.MEMBER_LOST, ("b",))
    assert "members lost: b" in w.reason
    assert nodes_waiting(partial(lost), 3, max_nodes=4).kind is MembershipChange.NEWER_ROUND
    assert nodes_waiting(partial(open_(5)), 4, max_nodes=4).kind is MembershipChange.NEWER_ROUND


def test_a_coordinator_whose_workers_finished_opens_no_round():
    """Regression (soak seed 777000): once the coordinator's own workers completed the job,
    a member lost meanwhile (its lease expired while it finished) and late joiners open or
    announce no round: the finished job is not trained again from a checkpoint."""
    v = replace(view(final(5, ["c", "n2"]), {"c", "n4", "n5"}, {6: ["n4", "n5"]}),
                coordinator="c")
    assert coordinate(v).kind is ActionKind.OPEN_NEXT, "the loss opens a round otherwise"
    a = coordinate(v, finishing=True)
    assert a.kind is ActionKind.NONE and "completed the job" in a.reason
    joiners = replace(view(final(5, ["c", "n2"]), {"c", "n2", "n4"}, {6: ["n4"]}),
                      coordinator="c")
    assert coordinate(joiners).kind is ActionKind.ANNOUNCE
    assert coordinate(joiners, finishing=True).kind is ActionKind.NONE


def test_only_the_coordinator_coordinates():
    """decide_coordination does nothing for a node that is not the coordinator or whose
    view is partial."""
    v = view(open_(0), {"a", "c"}, {0: ["a", "c"]})
    assert coordinate(replace(v, coordinator="a")).kind is ActionKind.NONE
    assert coordinate(replace(v, coordinator="c", full=False)).kind is ActionKind.NONE


def test_coordinator_closes_open_round_it_did_not_join():
    """The coordinator finalizes with the old protocol's rule (all live joined, or the last
    call), whether or not it joined itself: here it is training elsewhere."""
    v = replace(view(open_(3, ["b", "a"]), {"a", "b", "c"}, {3: ["a", "b"]}), coordinator="c")
    mem = CoordinatorMemory()
    first = coordinate(v, memory=mem, min_nodes=2, last_call=1.0)
    assert first.kind is ActionKind.WAIT and first.until == NOW + 1.0
    done = coordinate(v, memory=mem, min_nodes=2, last_call=1.0, now=NOW + 1.0)
    assert done.kind is ActionKind.FINALIZE and done.members == ("b", "a")


def test_coordinator_opens_next_round_for_loss_and_leave_and_announces_joiners():
    """In a final round the coordinator opens r+1 with the cause and nodes for a lost or a
    drained member; a late joiner with room is announced once (members drain first and
    open the round themselves); a finished member changes nothing."""
    base = final(4, ["a", "b", "c"])
    lost = coordinate(replace(view(base, {"a", "c"}), coordinator="c"))
    assert (lost.kind, lost.round, lost.cause, lost.changed) == (ActionKind.OPEN_NEXT, 5, "member_lost", ("b",))
    left = coordinate(replace(view(base, {"a", "c"}, left={4: {"b": LEFT_DRAINED}}), coordinator="c"))
    assert (left.kind, left.cause) == (ActionKind.OPEN_NEXT, "member_left")
    waiting = replace(view(base, {"a", "b", "c", "d"}, {5: ["d"]}), coordinator="c")
    join = coordinate(waiting)
    assert (join.kind, join.round, join.members) == (ActionKind.ANNOUNCE, 5, ("d",))
    assert coordinate(replace(waiting, announced=(5, ("d",)))).kind is ActionKind.NONE
    # The joiner's lease expired before the members re-formed: the announcement is withdrawn.
    gone = coordinate(replace(view(base, {"a", "b", "c"}), coordinator="c",
                              announced=(5, ("d",))))
    assert (gone.kind, gone.round, gone.members) == (ActionKind.ANNOUNCE, 5, ())
    # A member with a partial view reads the announcement (merged into its joins) as JOIN.
    w = nodes_waiting(partial(base, {5: ["d"]}), 4, max_nodes=4)
    assert (w.kind, w.nodes) == (MembershipChange.JOIN, ("d",))
    done = coordinate(replace(view(base, {"a", "c"}, left={4: {"b": LEFT_FINISHED}}), coordinator="c"))
    assert done.kind is ActionKind.NONE
    steady = coordinate(replace(view(base, {"a", "b", "c"}), coordinator="c"))
    assert steady.kind is ActionKind.NONE


def test_coordinator_defers_losses_after_etcd_trouble():
    """Lost members right after an etcd outage are given until defer_lost_until to
    re-register before the coordinator opens a round for them."""
    v = replace(view(final(4, ["a", "b", "c"]), {"a", "c"}), coordinator="c")
    wait = coordinate(v, defer_until=NOW + 3.0)
    assert wait.kind is ActionKind.WAIT and wait.until == NOW + 3.0
    assert coordinate(v, defer_until=NOW + 3.0, now=NOW + 3.0).kind is ActionKind.OPEN_NEXT


def test_members_dropped_from_the_next_round_are_reported_once():
    """A member missing from the finalized round is reported lost unless it left cleanly
    or its loss was reported when the round was opened (a member_lost cause)."""
    opened = RoundState(8, "open", ["a", "b", "c", "d"], 1, 4)
    view = RendezvousView(opened, frozenset({"a", "b"}), left={7: {"d": "drained"}})
    assert dropped_members(view, opened, ["a", "b"]) == ("c",)
    by_coordinator = RoundState(8, "open", ["a", "b", "c", "d"], 1, 4, cause="member_lost",
                                changed=["c"])
    assert dropped_members(view, by_coordinator, ["a", "b"]) == ()
    assert dropped_members(view, opened, ["a", "b", "c"]) == ()


def test_coordinator_publishes_the_verdict_once_every_member_reported():
    """Once every member of the final round reported a worker failure, the coordinator
    publishes the reporters in order (one key every node watches), once per round; with a
    report missing it waits."""
    members = ["a", "b", "c"]
    v = replace(view(final(1, members), set(members), failures={1: ["b", "a", "c"]}),
                coordinator="c")
    duty = coordinate(v)
    assert (duty.kind, duty.round, duty.members) == (ActionKind.ATTRIBUTE, 1, ("b", "a", "c"))
    assert "b first" in duty.reason
    assert coordinate(replace(v, attributed=1)).kind is not ActionKind.ATTRIBUTE
    missing = replace(v, failures={1: ["b", "a"]})
    assert coordinate(missing).kind is not ActionKind.ATTRIBUTE


def test_partial_view_decides_from_the_published_verdict():
    """A node that sees only its own report and the coordinator's verdict attributes the
    failure as a node that saw every report would."""
    own = RendezvousView(final(1, ["a", "b"]), frozenset(), {}, False, {1: ["a"]}, {},
                         coordinator="c", full=False)
    assert attribute_failure(own, 1, "a")[0] is Attribution.UNDECIDED
    verdict = replace(own, failures={1: ["b", "a"]}, attributed=1)
    assert attribute_failure(verdict, 1, "a")[0] is Attribution.VICTIM
    assert attribute_failure(verdict, 1, "b")[0] is Attribution.ROOT


def test_a_whole_round_lost_at_once_is_presumed_an_etcd_outage():
    """A coordinator that saw no etcd trouble itself still holds back the loss of every
    member of the final round at once (leases that went together after an etcd restart);
    the loss of some members, with no trouble seen, counts at once."""
    from elasticd.rendezvous.outage import presumed_outage

    state = final(1, ["a", "b"])
    assert presumed_outage(["a", "b"], state, saw_trouble=False)
    assert not presumed_outage(["a"], state, saw_trouble=False)
    assert presumed_outage(["a"], state, saw_trouble=True)
    assert not presumed_outage([], state, saw_trouble=True)
    assert not presumed_outage(["a", "b"], open_(1, ["a", "b"]), saw_trouble=False)


# --- hang ejection (issue 24 item 3) -------------------------------------------------------


def _hung_coordinate(v: RendezvousView, hung, **kw) -> Action:
    return decide_coordination(v, CoordinatorMemory(), me="c", min_nodes=1, max_nodes=4,
                               last_call_timeout_s=5.0, now=NOW, hung=hung, **kw)


def test_a_hung_member_is_ejected_by_opening_the_next_round_naming_it():
    """The coordinator turns find_hung's verdict into OPEN_NEXT with cause member_hung;
    nothing is done for a node that is not a member, or in a one-node round."""
    v = view(final(2, ["a", "b", "c"]), {"a", "b", "c"})
    v = replace(v, coordinator="c")
    a = _hung_coordinate(v, ("b", "stopped"))
    assert a.kind is ActionKind.OPEN_NEXT and a.round == 3
    assert a.cause == MembershipChange.MEMBER_HUNG.value and a.changed == ("b",)
    assert _hung_coordinate(v, ("x", "stopped")).kind is ActionKind.NONE
    solo = replace(view(final(2, ["c"]), {"c"}), coordinator="c")
    assert _hung_coordinate(solo, ("c", "stopped")).kind is ActionKind.NONE


def test_a_loss_wins_over_a_hang_and_a_hang_over_a_join():
    """A lost member opens the round as member_lost (the hang may be its consequence);
    joiners waiting cannot be admitted while a member hangs: the hang goes first."""
    lost = replace(view(final(2, ["a", "b", "c"]), {"b", "c"}), coordinator="c")
    assert _hung_coordinate(lost, ("b", "x")).cause == MembershipChange.MEMBER_LOST.value
    joining = replace(view(final(2, ["a", "b", "c"]), {"a", "b", "c", "d"}, {3: ["d"]}),
                      coordinator="c")
    a = _hung_coordinate(joining, ("b", "x"))
    assert a.kind is ActionKind.OPEN_NEXT and a.cause == MembershipChange.MEMBER_HUNG.value


def test_the_round_opened_for_a_hang_closes_without_the_ejected_node():
    """The ejected node neither joins that round nor holds its last call (it is alive);
    the others close it at once, and it joins the round after."""
    opened = replace(open_(3, ["a", "b", "c"]), cause=MembershipChange.MEMBER_HUNG.value,
                     changed=["b"])
    v = replace(view(opened, {"a", "b", "c"}, {3: ["a", "c"]}), coordinator="c")
    a = _hung_coordinate(v, None)
    assert a.kind is ActionKind.FINALIZE and a.members == ("a", "c")
    v = replace(view(opened, {"a", "b", "c"}, {3: ["a", "b", "c"]}), coordinator="c")
    assert _hung_coordinate(v, None).members == ("a", "c")
    # ...and the members' agents read it as a change naming b; b reads that it is named.
    w = nodes_waiting(view(opened, set()), 2, max_nodes=4)
    assert w.kind is MembershipChange.MEMBER_HUNG and w.nodes == ("b",)
    # The finalizer does not report b lost again (it was ejected, not lost).
    assert dropped_members(view(opened, {"a", "c"}), opened, ["a", "c"]) == ()


# --- straggler ejection and probation (issue 24 item 4) -----------------------------------


def test_a_straggler_is_ejected_as_member_slow_and_a_hang_goes_first():
    """``slow`` opens the next round with cause member_slow naming the node (like a hang,
    which wins when both are named); a loss wins over both."""
    v = replace(view(final(2, ["a", "b", "c"]), {"a", "b", "c"}), coordinator="c")
    a = _hung_coordinate(v, None, slow=("b", "1.6x"))
    assert a.kind is ActionKind.OPEN_NEXT and a.cause == MembershipChange.MEMBER_SLOW.value
    assert a.changed == ("b",)
    both = _hung_coordinate(v, ("a", "stopped"), slow=("b", "1.6x"))
    assert both.cause == MembershipChange.MEMBER_HUNG.value and both.changed == ("a",)
    lost = replace(view(final(2, ["a", "b", "c"]), {"b", "c"}), coordinator="c")
    assert _hung_coordinate(lost, None, slow=("b", "x")).cause == MembershipChange.MEMBER_LOST.value
    w = nodes_waiting(view(replace(open_(3, ["a", "b", "c"]), cause="member_slow",
                                   changed=["b"]), set()), 2, max_nodes=4)
    assert w.kind is MembershipChange.MEMBER_SLOW and w.nodes == ("b",)


def test_a_node_on_probation_is_neither_admitted_nor_announced_nor_waited_for():
    """On probation (``rdzv/probation/b``): b joined, but the round closes without it at
    once (no last call for it), a loss admits the others only, and b waiting to join a
    final round is no change; once its probation ends it is announced as any joiner."""
    on = {"b": "on probation"}
    opened = open_(4, ["a", "c"])
    v = replace(view(opened, {"a", "b", "c"}, {4: ["a", "b", "c"]}), coordinator="c",
                probation=on)
    a = _hung_coordinate(v, None)
    assert a.kind is ActionKind.FINALIZE and a.members == ("a", "c")
    # b alive, not joined: it holds no last call either.
    v = replace(view(opened, {"a", "b", "c"}, {4: ["a", "c"]}), coordinator="c", probation=on)
    assert _hung_coordinate(v, None).kind is ActionKind.FINALIZE
    running = view(final(3, ["a", "c"]), {"a", "b", "c"}, {4: ["b"]})
    assert nodes_waiting(replace(running, probation=on), 3, max_nodes=4).kind is MembershipChange.NONE
    w = nodes_waiting(running, 3, max_nodes=4)
    assert w.kind is MembershipChange.JOIN and w.nodes == ("b",)
    announce = _hung_coordinate(replace(running, coordinator="c"), None)
    assert announce.kind is ActionKind.ANNOUNCE and announce.members == ("b",)
    assert _hung_coordinate(replace(running, coordinator="c", probation=on), None).kind \
        is ActionKind.NONE
