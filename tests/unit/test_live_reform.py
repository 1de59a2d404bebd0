"""Live re-formation's pure parts: the agent's decision, the order's validation, and the
state transfer's (un)flattening."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import elasticd.worker.context as wctx
from elasticd.agent.reform import LiveFacts, LiveVerdict, decide_live
from elasticd.control.reform import ReformOrder
from elasticd.worker.live import _is_collective_failure
from elasticd.worker.transport.tree import flatten_state, unflatten_state

BASE = LiveFacts(enabled=True, workers_live=True, group_state="HEALTHY", verdict="continue")


def _v(**kw) -> LiveVerdict:
    return decide_live(dataclasses.replace(BASE, **kw)).verdict


def test_plain_scripts_and_a_disabled_agent_keep_the_restart_path():
    """No live markers, live off, or our own drain: the restart policy decides."""
    assert _v(workers_live=False, verdict="restart_membership") is LiveVerdict.NONE
    assert _v(enabled=False, parked_any_failure=True) is LiveVerdict.NONE
    assert _v(draining=True, verdict="restart_membership") is LiveVerdict.NONE


def test_a_failed_collective_opens_the_next_round_at_once():
    """A worker's failed collective re-forms now, without waiting for the dead node's lease."""
    assert _v(parked_any_failure=True) is LiveVerdict.REFORM


def test_membership_changes_reform_and_joins_park_first():
    """Lost/left peers re-form in place; joiners first make workers leave at an agreed step."""
    assert _v(verdict="restart_membership", membership="member_lost") is LiveVerdict.REFORM
    assert _v(verdict="start_resize", membership="join") is LiveVerdict.PARK
    assert _v(verdict="start_resize", membership="join", parking=True) is LiveVerdict.WAIT
    assert _v(verdict="start_resize", membership="join", parking=True, parked_all=True) is LiveVerdict.REFORM


def test_a_join_parks_first_even_when_the_policy_would_restart():
    """A join to a group that has not trained yet (the policy says restart) parks too: an order
    alone never moves a worker whose collectives all succeed (a node alone at world size 1)."""
    assert _v(verdict="restart_membership", membership="join") is LiveVerdict.PARK
    assert _v(verdict="restart_membership", membership="join", parking=True) is LiveVerdict.WAIT
    assert _v(verdict="restart_membership", membership="join", parking=True,
              parked_all=True) is LiveVerdict.REFORM


def test_a_reformation_completes_or_falls_back_after_its_bound():
    """Every worker confirms: done; the bound passes first: fall back to a restart."""
    assert _v(reforming=True) is LiveVerdict.WAIT
    assert _v(reforming=True, reformed_all=True) is LiveVerdict.DONE
    assert _v(reforming=True, deadline_passed=True) is LiveVerdict.FALLBACK
    assert _v(reforming=True, group_state="SUCCEEDED") is LiveVerdict.ABANDON


def test_workers_failing_before_they_took_the_order_restart_without_the_budget():
    """Workers that fail while an order is out and before they left their old group
    (a zombie's refused commit in the superseded round) fall back to the restart path, a
    membership change; once they parked or re-formed, a failure is the policy's again."""
    assert _v(reforming=True, group_state="FAILED") is LiveVerdict.FALLBACK
    assert _v(reforming=True, group_state="FAILED", left_old_all=True) is LiveVerdict.ABANDON
    assert _v(reforming=True, group_state="SUCCEEDED") is LiveVerdict.ABANDON
    assert _v(parking=True, group_state="FAILED") is LiveVerdict.ABANDON


def test_a_member_lost_during_a_reformation_falls_back_at_once():
    """A second loss while the workers form the new group: the group cannot form, so fall
    back now rather than after the bound; a join then waits for the re-formation to end."""
    lost = _v(reforming=True, verdict="restart_membership", membership="member_lost")
    assert lost is LiveVerdict.FALLBACK
    assert _v(reforming=True, verdict="restart_membership", membership="newer_round") is LiveVerdict.FALLBACK
    assert _v(reforming=True, verdict="start_resize", membership="join") is LiveVerdict.WAIT
    assert _v(reforming=True, reformed_all=True, verdict="restart_membership",
              membership="member_lost") is LiveVerdict.DONE


def test_the_policy_acts_first_on_stops_and_fences():
    """A stop signal, a drain or a lost lease is never overridden by live re-formation."""
    for verdict in ("start_drain", "fence", "hard_stop", "leave"):
        assert _v(verdict=verdict, parked_all=True) is LiveVerdict.NONE


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
    for name, value in (("ctx", ctx), ("control_dir", None), ("sigterm", False),
                        ("stopped", False), ("drainable_noted", True), ("ordered_round", -1)):
        monkeypatch.setattr(wctx._S, name, value)
    wctx.note_reform_order(3)
    assert not wctx.reform_ordered() and not wctx.should_stop(10)
    wctx.note_reform_order(4)
    wctx.note_reform_order(2)  # an older order read late does not undo the newer one
    assert wctx.reform_ordered() and wctx.should_stop(11)
    monkeypatch.setattr(wctx._S, "ctx", dataclasses.replace(ctx, round=4))  # re-formed
    monkeypatch.setattr(wctx._S, "stopped", False)
    assert not wctx.reform_ordered() and not wctx.should_stop(12)


def test_only_peer_failures_trigger_a_reformation():
    """A script bug (shape error) is re-raised; gloo's connection errors re-form."""
    assert _is_collective_failure(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
    assert not _is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not _is_collective_failure(ValueError("bad"))


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
