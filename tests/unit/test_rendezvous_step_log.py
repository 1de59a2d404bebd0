"""Which rendezvous steps a node logs at info (``etcd_handler.step_is_news``)."""

from __future__ import annotations

from elasticd.rendezvous.etcd_handler import step_is_news
from elasticd.rendezvous.protocol import Action, ActionKind, RendezvousView

WAIT = Action(ActionKind.WAIT, "round 0: joined, waiting for the coordinator (vm) to close it")


def test_a_one_node_job_waiting_for_its_own_coordinator_is_chatter():
    """A fresh-clone suite with two busy loops beside it saw the standalone quick start's log
    open with "joined, waiting for the coordinator (vm) to close it" at info: the node's own
    coordinator thread was a moment behind its handler. A one-node job never waits for
    anyone else, so that wait is debug; waits in larger jobs, or for another node, stay info."""
    ours = RendezvousView(state=None, alive=frozenset({"vm"}), coordinator="vm")
    assert not step_is_news(WAIT, ours, "vm", max_nodes=1)
    assert step_is_news(WAIT, ours, "vm", max_nodes=4)  # it waits for 3 more nodes to come
    other = RendezvousView(state=None, alive=frozenset({"vm", "b"}), coordinator="b")
    assert step_is_news(WAIT, other, "vm", max_nodes=1)
    assert not step_is_news(Action(ActionKind.JOIN, "round 0 is open: joining"), other, "vm", max_nodes=4)
