"""The watch health decision: a change etcd holds that a watch left undelivered for a
whole probe interval makes it silent; changes still in flight, or a busy range, do not."""

from __future__ import annotations

import pytest

from elasticd.etcd.watch_health import WatchLag, judge_watch, lag_resolved, watch_lag

pytestmark = pytest.mark.timeout(10)


def test_a_watch_that_delivered_everything_has_no_lag():
    """Probe and view agree: nothing pending, not silent."""
    v = judge_watch(None, {"/a": 5, "/b": 7}, 7, {"/a": 5, "/b": 7}, 9)
    assert not v.silent and v.pending is None


def test_an_undelivered_put_is_pending_then_silent_if_still_missing():
    """A put the watch has not delivered is in flight at the first probe, silent at the next."""
    first = judge_watch(None, {"/a": 5}, 5, {"/a": 5, "/b": 8}, 8)
    assert not first.silent and first.pending == WatchLag(8, frozenset())
    second = judge_watch(first.pending, {"/a": 5}, 5, {"/a": 5, "/b": 8}, 8)
    assert second.silent and "revision 8" in second.reason


def test_an_undelivered_delete_is_pending_then_silent_if_still_held():
    """A key etcd deleted that the watch still holds is silent one probe later."""
    first = judge_watch(None, {"/a": 5, "/b": 6}, 6, {"/a": 5}, 9)
    assert first.pending == WatchLag(0, frozenset({("/b", 6)}))
    second = judge_watch(first.pending, {"/a": 5, "/b": 6}, 6, {"/a": 5}, 9)
    assert second.silent and "/b" in second.reason


def test_a_busy_range_that_keeps_delivering_is_never_silent():
    """Each probe finds new changes in flight, but the previous probe's were delivered."""
    first = judge_watch(None, {"/a": 5}, 5, {"/a": 6}, 6)
    second = judge_watch(first.pending, {"/a": 6}, 6, {"/a": 7}, 7)
    assert not second.silent and second.pending == WatchLag(7, frozenset())
    third = judge_watch(second.pending, {"/a": 8}, 8, {"/a": 9}, 9)
    assert not third.silent


def test_a_key_created_after_the_probe_is_not_a_missing_delete():
    """A key the watch delivered after the probe's revision is not taken for a deletion."""
    assert watch_lag({"/a": 5, "/new": 12}, 12, {"/a": 5}, 10) is None


def test_a_deleted_then_recreated_key_resolves_the_delete():
    """The watch delivered the delete and a re-create: the old (key, revision) is resolved."""
    lag = WatchLag(0, frozenset({("/b", 6)}))
    assert lag_resolved(lag, {"/b": 11}, 11)
    assert not lag_resolved(lag, {"/b": 6}, 11)
