"""Pure parts of `elasticd stop`/`drain`: which mark applies to a node, what it says,
and the CLI's progress line."""

from __future__ import annotations

from elasticd.cli.control import progress_line
from elasticd.etcd.client import KV
from elasticd.keys import JobKeys
from elasticd.records import NodeRecord, StopMark
from elasticd.stopmarks import StopRequest, pending_request, restart_hint

KEYS = JobKeys("j")


def _kv(key: str, value: bytes = b"") -> KV:
    return KV(key, value, 1, 1, 0)


def test_no_mark_lets_the_node_run():
    """Nothing under control/, or only another node's drain: no request."""
    assert pending_request([], KEYS, "a") is None
    assert pending_request([_kv(KEYS.drain_mark("b"))], KEYS, "a") is None


def test_drain_applies_to_its_node_only_and_stop_to_every_node():
    """A drain mark names one node; the job's stop applies to all and wins over a drain."""
    mark = StopMark(1.0, by="ops@h", reason="disk swap").to_json().encode()
    drain = pending_request([_kv(KEYS.drain_mark("a"), mark)], KEYS, "a")
    assert drain == StopRequest("j", "a", StopMark(1.0, "ops@h", "disk swap"))
    assert drain.reason == "node 'a' drained by ops@h (elasticd drain): disk swap"
    both = pending_request([_kv(KEYS.drain_mark("a"), mark), _kv(KEYS.stop_mark)], KEYS, "a")
    assert both is not None and both.node is None


def test_an_unreadable_mark_still_counts():
    """A mark's presence is the request; a corrupt body only loses the who and why."""
    req = pending_request([_kv(KEYS.stop_mark, b"not json")], KEYS, "a")
    assert req == StopRequest("j", None, None)
    assert req.reason == "job 'j' stopped (elasticd stop)"


def test_restart_hints_name_the_command_that_clears_the_mark():
    """The hint of a stop clears the job; the hint of a drain clears that node."""
    assert "`elasticd start --job j`" in restart_hint(StopRequest("j", None, None))
    assert "`elasticd start --job j --node a`" in restart_hint(StopRequest("j", "a", None))


def test_progress_line_names_nodes_states_and_step():
    """The waiting line lists each remaining node with its state, the step, and the time."""
    rec = NodeRecord(node="a", host="h", pid=1, version="0", started_at=0.0, state="draining")
    line = progress_line({"a": rec, "b": None}, 42, 3.2, 180)
    assert line == "waiting for 2 nodes to drain and leave: a (draining), b; step 42 (3s of 180s)"
