"""A watch create waiting on a stream the client closed gives up at once
(``elasticd.etcd.watch.StreamClosedError``) and ``EtcdClient.add_watch`` makes it again on
the client's current stream.

Why: python3-etcd3 closes and replaces its watch stream on every failed call. A create put
on the closed stream is never sent; it used to wait out the whole call timeout, and each
create queued behind it on that stream waited out one more, so after an etcd restart a
node's last watch came back seconds after etcd did (soak seeds 73010, 73020). The stream
here is python3-etcd3's own ``Watcher`` over a stub whose stream never answers (no etcd)."""

from __future__ import annotations

import threading
import time

import etcd3.watch
import pytest

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.watch import StreamClosedError, WatchHandle

pytestmark = pytest.mark.timeout(30)

CALL_TIMEOUT_S = 600.0  # a create that waited it out would fail the test's own timeout


class _SilentStub:
    """A Watch RPC that never answers: requests are taken and dropped (a stream stuck on
    a dead connection)."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    def Watch(self, requests, **_):  # noqa: N802 (gRPC's name)
        for rq in requests:
            if rq is None:
                break
        self.stop.wait(CALL_TIMEOUT_S)
        return iter(())


def _create_in_thread(watcher, key: bytes) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["id"] = watcher.add_callback(key, lambda r: None)
        except Exception as exc:  # the outcome is what the test checks
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_creates_waiting_on_a_closed_stream_give_up_at_once():
    stub = _SilentStub()
    watcher = etcd3.watch.Watcher(stub, timeout=CALL_TIMEOUT_S)
    try:
        first, first_out = _create_in_thread(watcher, b"/a/")
        _wait_for(lambda: watcher._new_watch is not None, "the first create to be pending")
        second, second_out = _create_in_thread(watcher, b"/b/")  # queued behind the first
        watcher.close()  # what python3-etcd3 does when a call fails (_clear_old_stubs)
        for t in (first, second):
            t.join(timeout=10)
            assert not t.is_alive(), "a create still waits on a closed stream"
        assert isinstance(first_out.get("error"), StreamClosedError), first_out
        assert isinstance(second_out.get("error"), StreamClosedError), second_out
        # A create made on the closed stream afterwards gives up too, without waiting.
        late, late_out = _create_in_thread(watcher, b"/c/")
        late.join(timeout=10)
        assert isinstance(late_out.get("error"), StreamClosedError), late_out
    finally:
        stub.stop.set()


def test_a_create_that_sent_nothing_still_waits_out_its_timeout_on_an_open_stream():
    """The control: an open stream that does not answer is a timeout, not a closed stream."""
    stub = _SilentStub()
    watcher = etcd3.watch.Watcher(stub, timeout=0.2)
    try:
        with pytest.raises(etcd3.exceptions.WatchTimedOut):
            watcher.add_callback(b"/a/", lambda r: None)
    finally:
        stub.stop.set()


class _ClosedWatcher:
    def add_callback(self, *args, **kwargs):
        raise StreamClosedError()


class _Watcher:
    def add_callback(self, *args, **kwargs):
        return 5


class _Raw:
    """python3-etcd3's client as ``add_watch`` uses it: ``watcher`` is the current stream."""

    _current_endpoint_label = "127.0.0.1:2379"
    endpoints: dict = {}

    def __init__(self, streams: list) -> None:
        self._streams = iter(streams)

    @property
    def watcher(self):
        return next(self._streams)


def test_add_watch_makes_the_create_again_on_the_current_stream(monkeypatch):
    """The client replaced the stream while the create waited: made again on the new one."""
    raw = _Raw([_ClosedWatcher(), _Watcher()])
    client = EtcdClient("127.0.0.1:2379")
    monkeypatch.setattr(client, "raw", lambda: raw)
    handle = client.add_watch("/job/", lambda r: None, 1)
    assert isinstance(handle, WatchHandle) and isinstance(handle.watcher, _Watcher)
    assert handle.watch_id == 5
