"""Live re-formation's pure parts: its place in the one restart policy (``policy.decide``
over ``Facts.live``), the order's validation, and the state transfer's (un)flattening."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import elasticd.worker.context as wctx
from elasticd.agent.policy import (
    Attribution,
    Facts,
    GroupState,
    LiveFacts,
    LivePhase,
    Verdict,
    decide,
)
from elasticd.control.reform import ReformOrder
from elasticd.rendezvous.protocol import MembershipChange
from elasticd.worker.transport.tree import flatten_state, unflatten_state

HEALTHY = Facts(group_state=GroupState.HEALTHY, first_start=False, any_progress=True,
                remaining_restarts=3, live=LiveFacts())
IDLE, PARKING, REFORMING = LivePhase.IDLE, LivePhase.PARKING, LivePhase.REFORMING
JOIN, LOST = MembershipChange.JOIN, MembershipChange.MEMBER_LOST


def _facts(live: dict | None = None, **kw) -> Facts:
    f = dataclasses.replace(HEALTHY, **kw)
    if live is not None:
        f = dataclasses.replace(f, live=dataclasses.replace(f.live or LiveFacts(), **live))
    return f


def _v(live: dict | None = None, **kw) -> Verdict:
    return decide(_facts(live, **kw)).verdict


def _nodes(kind: MembershipChange) -> dict:
    """Facts of nodes waiting in a HEALTHY group (the restart policy would act on them)."""
    return {"nodes_waiting": 1, "membership": kind, "membership_reason": kind.value}


def test_plain_scripts_and_a_disabled_agent_keep_the_restart_path():
    """No live facts (live off, or a worker did not register) or our own drain: the restart
    policy's verdict, unchanged."""
    assert decide(dataclasses.replace(_facts(**_nodes(LOST)), live=None)).verdict \
        is Verdict.RESTART_MEMBERSHIP
    assert _v({"parked_any_failure": True}, draining=True) is Verdict.CONTINUE


def test_a_failed_collective_opens_the_next_round_at_once():
    """A worker's failed collective re-forms now, without waiting for the dead node's lease."""
    d = decide(_facts({"parked_any_failure": True}))
    assert d.verdict is Verdict.REFORM_LIVE and "collective failed" in d.reason


def test_membership_changes_reform_and_joins_park_first():
    """Lost/left peers re-form in place; joiners first make workers leave at an agreed step."""
    assert _v(**_nodes(LOST)) is Verdict.REFORM_LIVE
    assert _v(**_nodes(MembershipChange.MEMBER_LEFT)) is Verdict.REFORM_LIVE
    assert _v(**_nodes(JOIN), workers_drainable=True) is Verdict.PARK
    assert _v({"phase": PARKING}, **_nodes(JOIN), workers_drainable=True) is Verdict.LIVE_WAIT
    assert _v({"phase": PARKING, "parked_all": True}, **_nodes(JOIN),
              workers_drainable=True) is Verdict.REFORM_LIVE


def test_a_join_parks_first_even_when_the_policy_would_restart():
    """A join to a group that cannot drain (the restart policy says restart) parks too: an
    order alone never moves a worker whose collectives all succeed (a node alone at world
    size 1)."""
    assert decide(dataclasses.replace(_facts(**_nodes(JOIN)), live=None)).verdict \
        is Verdict.RESTART_MEMBERSHIP
    assert _v(**_nodes(JOIN)) is Verdict.PARK
    assert _v({"phase": PARKING}, **_nodes(JOIN)) is Verdict.LIVE_WAIT
    assert _v({"phase": PARKING, "deadline_passed": True}, **_nodes(JOIN)) is Verdict.LIVE_FALLBACK


def test_a_reformation_completes_or_falls_back_after_its_bound():
    """Every worker confirms: done; the bound passes first: fall back to a restart."""
    assert _v({"phase": REFORMING}) is Verdict.LIVE_WAIT
    assert _v({"phase": REFORMING, "reformed_all": True}) is Verdict.LIVE_DONE
    assert _v({"phase": REFORMING, "deadline_passed": True}) is Verdict.LIVE_FALLBACK


def test_workers_failing_before_they_took_the_order_restart_in_the_round_without_the_budget():
    """Workers that fail while an order is out and before they left their old group (a
    zombie's refused commit in the superseded round) start again cold in the round being
    re-formed, a membership change (no budget): a newer round would make the peers
    re-forming for this one fall back to the checkpoint."""
    failed = {"group_state": GroupState.FAILED, "exit_codes": (1,)}
    d = decide(_facts({"phase": REFORMING}, **failed))
    assert d.verdict is Verdict.RESTART_IN_ROUND and not d.spends_budget, d
    assert "superseded round" in d.reason and not d.live_abandoned
    d = decide(_facts({"phase": REFORMING}, **failed, attribution=Attribution.ROOT, remaining_restarts=0))
    assert d.verdict is Verdict.RESTART_IN_ROUND and not d.spends_budget, d
    # A fence, a stop or a configuration error still act first, the re-formation abandoned.
    d = decide(_facts({"phase": REFORMING}, **failed, lease_lost=True))
    assert d.verdict is Verdict.FENCE and d.live_abandoned
    assert _v({"phase": REFORMING}, **failed, drain_signals=1) is Verdict.START_DRAIN
    d = decide(_facts({"phase": REFORMING}, group_state=GroupState.FAILED, exit_codes=(78,)))
    assert d.verdict is Verdict.FAIL and d.exit_code == 78 and d.live_abandoned


def test_workers_failing_after_they_parked_restart_in_the_round_as_the_policy_judges():
    """Once they parked or re-formed, a failure is the restart policy's again: it waits for
    the attribution window with the re-formation still under way, then the workers start
    again in its round (a root failure spends the budget, a peer's does not); a verdict
    that gives up abandons it. A park (no round of ours yet) or a completion abandons it."""
    failed = {"group_state": GroupState.FAILED, "exit_codes": (1,)}
    parked = {"phase": REFORMING, "left_old_all": True}
    d = decide(_facts(parked, **failed))
    assert d.verdict is Verdict.ATTRIBUTE and not d.live_abandoned
    d = decide(_facts(parked, **failed, attribution=Attribution.ROOT))
    assert d.verdict is Verdict.RESTART_IN_ROUND and d.spends_budget, d
    d = decide(_facts(parked, **failed, attribution=Attribution.VICTIM))
    assert d.verdict is Verdict.RESTART_IN_ROUND and not d.spends_budget, d
    d = decide(_facts(parked, **failed, attribution=Attribution.ROOT, remaining_restarts=0))
    assert d.verdict is Verdict.FAIL and "budget" in d.live_abandoned
    d = decide(_facts(parked, group_state=GroupState.FAILED, exit_codes=(78,)))
    assert d.verdict is Verdict.FAIL and d.exit_code == 78 and d.live_abandoned
    d = decide(_facts({"phase": PARKING}, **failed))
    assert d.verdict is Verdict.ATTRIBUTE and d.live_abandoned
    d = decide(_facts({"phase": REFORMING}, group_state=GroupState.SUCCEEDED))
    assert d.verdict is Verdict.FINISH and d.live_abandoned
    assert not decide(_facts(**failed)).live_abandoned  # nothing under way: nothing to abandon


def test_a_local_worker_dying_with_every_node_still_in_the_job_restarts_in_the_round():
    """A local worker dies while the job re-forms live with every node still in it (its
    local peers' collective failed first, or its node joined a peer's re-formation before
    its agent saw the death): the dead worker was the cause, so the budget is spent (a
    fresh-clone suite saw the dashboard's restart counter stay at 0 when it was not), and
    the workers start again cold in the round being re-formed, never through a newer round
    (the peers then fell back to the checkpoint: step 0 before the first one, issue 45)."""
    failed = {"group_state": GroupState.FAILED, "exit_codes": (-9,)}
    live = {"phase": REFORMING, "nobody_left": True}
    d = decide(_facts(live, **failed))
    assert d.verdict is Verdict.ATTRIBUTE and not d.live_abandoned
    root = {**failed, "attribution": Attribution.ROOT}
    d = decide(_facts(live, **root))
    assert d.verdict is Verdict.RESTART_IN_ROUND and d.spends_budget, d
    assert "no node left" in d.reason and "round being re-formed" in d.reason
    d = decide(_facts(live, **failed, attribution_window_passed=True))
    assert d.verdict is Verdict.RESTART_IN_ROUND and d.spends_budget, d
    d = decide(_facts(live, **root, remaining_restarts=0))
    assert d.verdict is Verdict.FAIL and d.live_abandoned
    assert _v({**live, "deadline_passed": True}, **root) is Verdict.RESTART_IN_ROUND
    assert _v(live, **root, lease_lost=True) is Verdict.FENCE


def test_a_member_lost_during_a_reformation_falls_back_at_once():
    """A second loss while the workers form the new group: the group cannot form, so fall
    back now rather than after the bound; a join then waits for the re-formation to end."""
    assert _v({"phase": REFORMING}, **_nodes(LOST)) is Verdict.LIVE_FALLBACK
    assert _v({"phase": REFORMING}, **_nodes(MembershipChange.NEWER_ROUND)) is Verdict.LIVE_FALLBACK
    assert _v({"phase": REFORMING}, **_nodes(JOIN), workers_drainable=True) is Verdict.LIVE_WAIT
    assert _v({"phase": REFORMING, "reformed_all": True}, **_nodes(LOST)) is Verdict.LIVE_DONE


def test_stops_fences_hangs_and_completion_act_before_live_reformation():
    """A stop signal, a lost lease, a hang or finished workers are never overridden by a
    live re-formation, whatever its workers report."""
    live = {"parked_all": True, "parked_any_failure": True, "phase": REFORMING}
    assert _v(live, lease_lost=True) is Verdict.FENCE
    assert _v(live, drain_signals=1, workers_drainable=True) is Verdict.START_DRAIN
    assert _v(live, drain_signals=2, draining=True) is Verdict.HARD_STOP
    assert _v(live, hang=True) is Verdict.RESTART_FAILURE
    assert _v(live, workers_done=True, done_exit_passed=True) is Verdict.FINISH


def test_every_live_verdict_carries_its_reason():
    """Each live verdict says why (logged once when it changes), as the restart verdicts do."""
    cases = [_facts({"parked_any_failure": True}), _facts(**_nodes(JOIN)),
             _facts({"phase": REFORMING}), _facts({"phase": REFORMING, "reformed_all": True}),
             _facts({"phase": REFORMING, "deadline_passed": True})]
    seen = {decide(f).verdict: decide(f).reason for f in cases}
    assert set(seen) == {Verdict.REFORM_LIVE, Verdict.PARK, Verdict.LIVE_WAIT, Verdict.LIVE_DONE,
                         Verdict.LIVE_FALLBACK}
    assert all(seen.values())


def test_order_round_trips_and_rejects_garbage():
    """The order file is validated: bad ranks, ports or types read as invalid."""
    order = ReformOrder(round=7, world_size=3, master_addr="10.0.0.1", master_port=29500, ranks={0: 2, 1: 1})
    assert ReformOrder.from_json(order.to_json()) == order
    for bad in ('{"round": 1}', '[]', order.to_json().replace("29500", "70000"),
                order.to_json().replace('"0": 2', '"0": 5')):
        with pytest.raises(ValueError):
            ReformOrder.from_json(bad)


def test_state_split_and_join_preserve_structure_and_tensors():
    """The broadcast's skeleton/tensor split is lossless (tuples, lists, nested dicts)."""
    sd = {"a": torch.arange(3.0), "b": [1, (torch.ones(2, 2), "x")], "c": {"d": 5}}
    skeleton, tensors = flatten_state(sd)
    back = unflatten_state(skeleton, tensors)
    assert torch.equal(back["a"], sd["a"]) and back["b"][0] == 1 and back["b"][1][1] == "x"
    assert torch.equal(back["b"][1][0], torch.ones(2, 2)) and back["c"] == {"d": 5}


def test_an_order_for_a_newer_round_stops_a_lone_worker_at_its_next_step(monkeypatch):
    """A worker whose agent ordered a newer round than its own stops at the next step
    boundary (should_stop: the agreed-step path), even alone at world size 1 where no
    collective fails; an order for its own round or an older one changes nothing."""
    ctx = wctx.WorkerContext(rank=0, world_size=1, local_rank=0, local_world_size=1,
                             device=torch.device("cpu"), backend="gloo", restart_count=0,
                             round=3, job="j", node="b", checkpoint_url=None, under_agent=True)
    monkeypatch.setattr(wctx, "_RUNTIME", wctx.WorkerRuntime(ctx))
    wctx.note_reform_order(3)
    assert not wctx.reform_ordered() and not wctx.should_stop(10)
    wctx.note_reform_order(4)
    wctx.note_reform_order(2)  # an older order read late does not undo the newer one
    assert wctx.reform_ordered() and wctx.should_stop(11)
    monkeypatch.setattr(wctx, "_RUNTIME", wctx.WorkerRuntime(dataclasses.replace(ctx, round=4)))  # re-formed
    wctx.note_reform_order(4)
    assert not wctx.reform_ordered() and not wctx.should_stop(12)


def test_only_the_groups_own_connections_are_shut_down():
    """Waking a wait on a frozen peer shuts down the sockets the process groups opened,
    never a user's own TCP connection (a data server, storage, a tracker)."""
    import socket

    from elasticd.worker.sockets import shutdown_group_connections, socket_links

    with socket.create_server(("127.0.0.1", 0)) as server:
        before = socket_links()
        group_side = socket.create_connection(server.getsockname())
        group_links = frozenset(socket_links() - before)
        user_side = socket.create_connection(server.getsockname())
        peers = [server.accept()[0], server.accept()[0]]
        try:
            assert shutdown_group_connections(group_links) == 1
            user_side.sendall(b"still open")
            assert peers[1].recv(16) == b"still open"
            assert peers[0].recv(16) == b""  # the group's connection was shut down
        finally:
            for s in (group_side, user_side, *peers):
                s.close()
