"""``PrefixWatch``: a prefix watch that survives etcd restarts and dropped streams.

python3-etcd3's watch dies silently with its stream (and its ``watch.py`` uses ``six``
without importing it: patched in below, before any watch exists). This module
re-creates the watch from the last seen revision + 1 whenever the stream dies, and takes
a fresh snapshot when that revision was compacted. A watch can also go silent with no error
at all (etcd restarted, or cancelled it behind the client's back): a health check compares it
with a keys-only read of its range every ``health_interval_s`` and re-creates it when a
change etcd holds stays undelivered for a whole interval (``elasticd.etcd.watch_health``).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import etcd3.exceptions
import etcd3.watch
import structlog
from etcd3 import events as etcd_events

from elasticd.etcd.kv import KV, WatchEvent
from elasticd.etcd.watch_health import WatchLag, judge_watch

if TYPE_CHECKING:
    from elasticd.etcd.client import EtcdClient

log = structlog.get_logger(__name__)

# How often a watch is checked against a read of its range: a silent watch is re-created
# within two of these. One keys-only range read per watch and interval.
WATCH_HEALTH_INTERVAL_S = 5.0

# Work-around: etcd3/watch.py calls six.itervalues without importing six.
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(list(d.values())))  # type: ignore[attr-defined]


class StreamClosedError(Exception):
    """A watch create was waiting on a stream the client has since closed and replaced (it
    does so on every failed call: ``_clear_old_stubs``). Nothing would ever send the create:
    it used to wait out the whole call timeout, and the creates queued behind it on that
    stream each waited out one more, so after an etcd restart a node's last watch came back
    seconds after etcd did (soak seeds 73010, 73020: a coordinator's ``joins`` watch was
    deaf for 6 s and 9 s). ``EtcdClient.add_watch`` retries at once on the current stream.
    """


# Work-around: python3-etcd3 (0.13) pairs a watch's "created" answer with whichever create
# is pending when it arrives. A create that timed out (etcd slow or restarting) still gets
# its answer later, and if another create is pending by then, that one is handed the
# timed-out watch's id: it receives the other key range's events, and its own watch is
# cancelled. A rendezvous watch crossed that way never sees the round state again and the
# job stops (soak seed 880003: the coordinator's creates timed out through an etcd restart
# and its view of rdzv/ froze at the old round). etcd answers creates in the order a stream
# sent them, so the answers of timed-out creates come first: count them ("ghosts") with the
# stream they were sent on and cancel them as they come.
def _add_callback(self: Any, key: Any, callback: Any, range_end: Any = None,
                  start_revision: Any = None, progress_notify: bool = False,
                  filters: Any = None, prev_kv: bool = False) -> int:
    rq = self._create_watch_request(key, range_end=range_end, start_revision=start_revision,
                                    progress_notify=progress_notify, filters=filters,
                                    prev_kv=prev_kv)
    with self._lock:
        if self._stopping:
            self._callback_thread.join()
            self._callback_thread = None
            self._stopping = False
        if not self._callback_thread:
            self._callback_thread = threading.Thread(name=f"etcd3_watch_{id(self):x}",
                                                     target=self._run, daemon=True)
            self._callback_thread.start()
        while self._new_watch and not _closed(self):
            self._new_watch_cond.wait()
        if _closed(self):
            raise StreamClosedError()
        new_watch = etcd3.watch._NewWatch(callback)
        queue = self._request_queue
        queue.put(rq)
        self._new_watch = new_watch
        try:
            deadline = time.monotonic() + self.timeout
            while new_watch.id is None and new_watch.err is None and not _closed(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._new_watch_cond.wait(timeout=left)
            if new_watch.id is None and new_watch.err is None:
                # Its answer may still come, on this stream: it is a ghost's.
                if getattr(self, "_ghost_queue", None) is not queue:
                    self._ghost_queue, self._ghosts = queue, 0
                self._ghosts += 1
                raise StreamClosedError() if _closed(self) else etcd3.exceptions.WatchTimedOut()
            if new_watch.err:
                raise new_watch.err
        finally:
            self._new_watch = None
            self._new_watch_cond.notify_all()
        return int(new_watch.id)


_original_handle_response = etcd3.watch.Watcher._handle_response


def _handle_response(self: Any, rs: Any) -> None:
    if rs.created:
        with self._lock:
            if getattr(self, "_ghosts", 0) and self._ghost_queue is self._request_queue:
                self._ghosts -= 1
                self._cancel_no_lock(rs.watch_id)
                return
    _original_handle_response(self, rs)


_original_close = etcd3.watch.Watcher.close


def _close(self: Any) -> None:
    # Remember which request queue was closed: nobody reads it any more (see cancel_on and
    # StreamClosedError). Creates waiting on this stream give up at once.
    with self._lock:
        self._closed_queue = self._request_queue
        self._new_watch_cond.notify_all()
    _original_close(self)


def _closed(watcher: Any) -> bool:
    """The client closed ``watcher``'s request side (it replaced the stream): a create put
    there now is never sent (under the watcher's lock)."""
    return getattr(watcher, "_closed_queue", None) is watcher._request_queue


if not getattr(etcd3.watch.Watcher, "_elasticd_patched", False):
    etcd3.watch.Watcher.add_callback = _add_callback  # type: ignore[method-assign]
    etcd3.watch.Watcher._handle_response = _handle_response  # type: ignore[method-assign]
    etcd3.watch.Watcher.close = _close  # type: ignore[method-assign]
    etcd3.watch.Watcher._elasticd_patched = True  # type: ignore[attr-defined]


@dataclass(frozen=True)
class WatchHandle:
    """A watch as etcd knows it: its id *and* the stream (python3-etcd3 ``Watcher``) it
    lives on. Watch ids are numbered per stream, from 0.

    Why: python3-etcd3 replaces its watcher (a new stream) whenever any call fails with
    UNAVAILABLE/DEADLINE_EXCEEDED, while the old stream lives on and keeps serving the
    watches on it. Cancelling by bare id on the *current* watcher then cancelled another
    watch that got the same number on the new stream; that watch went silent for good (no
    error, no events; soak seed 880015: a coordinator's ``joins`` watch, after an etcd
    kill and restart, and a round closed without a member).
    """

    watcher: Any  # python3-etcd3's etcd3.watch.Watcher (untyped library)
    watch_id: int


def cancel_on(handle: WatchHandle) -> None:
    """Cancel ``handle``'s watch on the stream it was created on (never another stream's
    watch of the same number). A stream already gone has forgotten its watches; one whose
    request side was closed still delivers to the watches on it but reads no requests, so
    only its callback is dropped (its bounded queue would fill and block)."""
    watcher = handle.watcher
    with watcher._lock:
        if watcher._callbacks.pop(handle.watch_id, None) is None:
            return
        if getattr(watcher, "_closed_queue", None) is watcher._request_queue:
            return
        rq = etcd3.etcdrpc.WatchRequest(
            cancel_request=etcd3.etcdrpc.WatchCancelRequest(watch_id=handle.watch_id))
        try:
            watcher._request_queue.put_nowait(rq)
        except queue.Full:  # a stuck stream: dropping the callback is what matters
            pass


class PrefixWatch:
    """A watch on a prefix that survives etcd restarts, dropped streams and silence.

    Contract: ``on_resync(kvs, revision)`` is called first with a full snapshot, and again
    after a reconnect that needed one (the consumer replaces its view); ``on_events(events)``
    is called for each change after the snapshot, in revision order, from one stream at a
    time, each change once. A reconnect resumes from the last delivered revision + 1, so no
    change is missed; if that revision was compacted, a fresh snapshot is taken instead.
    Every ``health_interval_s`` the watch is compared with a keys-only read of its range;
    one that left a change undelivered for a whole interval is re-created the same way.
    """

    def __init__(self, client: EtcdClient, prefix: str,
                 on_events: Callable[[list[WatchEvent]], None],
                 on_resync: Callable[[list[KV], int], None], *, name: str = "",
                 range_end: str | None = None,
                 health_interval_s: float = WATCH_HEALTH_INTERVAL_S) -> None:
        self._client = client
        self._prefix = prefix
        self._range_end = range_end  # None: every key under prefix; else [prefix, range_end)
        self._on_events = on_events
        self._on_resync = on_resync
        self._name = name or prefix
        self._health_interval_s = health_interval_s
        self._stop = threading.Event()
        self._broken = threading.Event()
        self._lock = threading.Lock()
        self._watch_id: WatchHandle | None = None
        # Delivery state, under _delivery: the stream generation whose callbacks may deliver
        # (an abandoned stream's late events are dropped), the last revision delivered, and
        # key -> mod_revision of what was delivered (for the health check; keys only).
        self._delivery = threading.Lock()
        self._generation = 0
        self._revision = 0
        self._view: dict[str, int] = {}
        self._pending: WatchLag | None = None
        self._need_snapshot = True
        self._thread = threading.Thread(target=self._run, name=f"watch:{self._name}", daemon=True)
        self.connected = threading.Event()
        self.recreated = 0  # times the health check found the watch silent

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """Stop the watch. ``wait=False`` returns at once: the watch thread cancels its own
        watch on the way out (with etcd down, a cancel or a reconnect attempt can block for
        the call timeout, which a caller with a deadline cannot spend)."""
        self._stop.set()
        self._broken.set()
        if not wait:
            return
        with self._lock:
            wid, self._watch_id = self._watch_id, None
        if wid is not None:
            self._client.cancel_watch(wid)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    @property
    def name(self) -> str:
        return self._name

    @property
    def revision(self) -> int:
        return self._revision

    def reconnect(self) -> None:
        """Drop the current stream and resume from the last revision + 1 (the client moved
        to another endpoint)."""
        self.connected.clear()
        self._broken.set()

    def _callback(self, response: Any, generation: int | None = None) -> None:
        if self._stop.is_set():
            return
        with self._delivery:
            if generation is not None and generation != self._generation:
                return  # a stream this watch has left: its events come again on the new one
            self._deliver(response)

    def _deliver(self, response: Any) -> None:
        if isinstance(response, Exception) or not hasattr(response, "events"):
            if isinstance(response, etcd3.exceptions.RevisionCompactedError):
                self._need_snapshot = True
            self._abandon()
            return
        out: list[WatchEvent] = []
        for ev in response.events:
            if ev.mod_revision <= self._revision:
                continue  # replay after reconnect
            key = ev.key.decode()
            if not self._covers(key):
                # Another watch's event: the client crossed two watches (see the work-around
                # above). Start over from a snapshot rather than feed the consumer a key it
                # never asked for, or miss its own.
                log.warning("etcd_watch_crossed", watch=self._name, key=key)
                self._need_snapshot = True
                self._abandon()
                return
            value = None if isinstance(ev, etcd_events.DeleteEvent) else ev.value
            out.append(WatchEvent(key, value, ev.mod_revision))
        if not out:
            return
        self._revision = max(e.mod_revision for e in out)
        for e in out:
            if e.value is None:
                self._view.pop(e.key, None)
            else:
                self._view[e.key] = e.mod_revision
        try:
            self._on_events(out)
        except Exception:
            log.exception("watch_consumer_failed", watch=self._name)

    def _abandon(self) -> None:
        """Leave the current stream (under _delivery): nothing more from it is delivered."""
        self._generation += 1
        self.connected.clear()
        self._broken.set()

    def _covers(self, key: str) -> bool:
        if self._range_end is None:
            return key.startswith(self._prefix)
        return self._prefix <= key < self._range_end

    def _connect(self) -> None:
        # Cleared before the new watch exists, never after: a stop() or a stream break that
        # lands while we connect must still wake the park in _run (else it parks forever
        # and the watch leaks).
        self._broken.clear()
        with self._delivery:
            self._generation += 1
            generation = self._generation
            self._pending = None
        if self._need_snapshot:
            kvs, rev = self._client.get_prefix(self._prefix, range_end=self._range_end)
            with self._delivery:
                self._revision = rev
                self._view = {kv.key: kv.mod_revision for kv in kvs}
                self._on_resync(kvs, rev)
            self._need_snapshot = False
        wid = self._client.add_watch(self._prefix, functools.partial(self._callback, generation=generation),
                                     self._revision + 1, range_end=self._range_end)
        with self._lock:
            self._watch_id = wid
        self.connected.set()

    def _check_health(self) -> None:
        """Probe the range and judge the watch; abandon its stream if it went silent."""
        try:
            kvs, probe_revision = self._client.get_prefix(self._prefix, keys_only=True,
                                                          range_end=self._range_end)
        except Exception:  # etcd unreachable: nothing to judge (a broken stream says so)
            return
        probe = {kv.key: kv.mod_revision for kv in kvs}
        with self._delivery:
            verdict = judge_watch(self._pending, self._view, self._revision, probe,
                                  probe_revision)
            self._pending = verdict.pending
            if verdict.silent:
                self.recreated += 1
                self._abandon()
        if verdict.silent:
            log.warning("etcd_watch_went_silent", watch=self._name, reason=verdict.reason,
                        revision=self._revision)

    def _run(self) -> None:
        backoff = 0.05
        failing = False
        while not self._stop.is_set():
            try:
                self._connect()
                if failing:
                    log.info("etcd_watch_resumed", watch=self._name, revision=self._revision)
                failing, backoff = False, 0.05
                # Park until the stream breaks (callback or health check sets _broken) or we
                # are stopped (stop() sets _stop before _broken, so one of the two is seen).
                while not self._stop.is_set() and not self._broken.wait(self._health_interval_s):
                    self._check_health()
            except Exception as exc:
                if self._stop.is_set():
                    break
                if not failing:
                    log.warning("etcd_watch_interrupted", watch=self._name, error=str(exc))
                failing = True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 1.0)
            with self._lock:
                wid, self._watch_id = self._watch_id, None
            if wid is not None:  # whoever takes the id cancels it (stop() may have missed it)
                self._client.cancel_watch(wid)
