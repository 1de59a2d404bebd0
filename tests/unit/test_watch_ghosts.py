"""python3-etcd3's watcher, as patched by elasticd.etcd.watch: the late answer of a create
that timed out is never handed to the next create (soak seed 880003)."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import etcd3.exceptions
import etcd3.watch
import pytest

import elasticd.etcd.watch  # noqa: F401 - applies the patch


class ScriptedStub:
    """A Watch stub: requests are recorded, answers are fed by the test."""

    def __init__(self) -> None:
        self.answers: queue.Queue = queue.Queue()
        self.requests: list = []

    def Watch(self, requests, credentials=None, metadata=None):  # noqa: N802 - gRPC's name
        def pump() -> None:
            for rq in requests:
                self.requests.append(rq)
        threading.Thread(target=pump, daemon=True).start()
        while True:
            rs = self.answers.get(timeout=10)
            if rs is None:
                return
            yield rs


def created(watch_id: int) -> SimpleNamespace:
    return SimpleNamespace(created=True, canceled=False, compact_revision=0, watch_id=watch_id,
                           events=[], header=None)


def test_a_late_created_answer_goes_to_its_timed_out_create_not_the_next():
    """Create A times out; B is pending when A's answer (id 1) and then B's (id 2) arrive:
    B gets id 2 and A's watch is cancelled (unpatched, B got id 1: A's key range)."""
    stub = ScriptedStub()
    w = etcd3.watch.Watcher(stub, timeout=0.2)
    with pytest.raises(etcd3.exceptions.WatchTimedOut):
        w.add_callback(b"/a", lambda r: None)
    w.timeout = 5
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(w.add_callback(b"/b", lambda r: None)))
    t.start()
    wait_for(lambda: w._new_watch is not None, "B's create to be pending")
    stub.answers.put(created(1))  # A's answer, late
    stub.answers.put(created(2))  # B's
    t.join(timeout=10)
    assert got == [2]

    def cancelled() -> list[int]:
        return [rq.cancel_request.watch_id for rq in list(stub.requests)
                if rq.HasField("cancel_request")]

    wait_for(lambda: cancelled() == [1], "A's watch to be cancelled")
    stub.answers.put(None)


def wait_for(pred, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_a_prefix_watch_given_another_ranges_event_starts_over_from_a_snapshot():
    """An event outside the watch's key range (two watches crossed) is not passed on: the
    watch reconnects from a fresh snapshot."""
    from etcd3 import events as etcd_events

    from elasticd.etcd.watch import PrefixWatch

    seen: list = []
    w = PrefixWatch(None, "/j/rdzv/", seen.extend, lambda kvs, rev: None,  # type: ignore[arg-type]
                    range_end="/j/rdzv/failures/")
    w._need_snapshot = False

    def put(key: bytes, rev: int):
        kv = SimpleNamespace(key=key, value=b"v", mod_revision=rev, create_revision=rev,
                             version=1, lease=0)
        return etcd_events.PutEvent(SimpleNamespace(kv=kv))

    w._callback(SimpleNamespace(events=[put(b"/j/rdzv/coordinator", 5)]))
    assert [e.key for e in seen] == ["/j/rdzv/coordinator"] and not w._broken.is_set()
    w._callback(SimpleNamespace(events=[put(b"/j/rdzv/joins/0000000001/n2", 6)]))
    assert len(seen) == 1 and w._broken.is_set() and w._need_snapshot
