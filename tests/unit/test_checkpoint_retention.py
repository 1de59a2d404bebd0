"""Retention policy: what pruning deletes, and what it must never delete."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.checkpoint.retention import RetentionPolicy, StoredSave, plan_prune

NOW = 10_000.0


def _save(step: int, *, age: float = 3600.0, committed: bool = True, sid: str | None = None) -> StoredSave:
    return StoredSave(step=step, save_id=sid or f"{step:013d}-00000000", created_at=NOW - age,
                      committed=committed)


def _deleted(decisions) -> list[int]:
    return sorted(d.save.step for d in decisions)


def test_keeps_newest_k_committed():
    """keep_last=2 deletes every committed step but the two newest."""
    saves = [_save(s) for s in (10, 20, 30, 40)]
    assert _deleted(plan_prune(saves, RetentionPolicy(keep_last=2), now=NOW)) == [10, 20]


def test_keep_every_spares_multiples():
    """keep_every=20 keeps steps 20 and 40 beyond the newest K."""
    saves = [_save(s) for s in (10, 20, 30, 40, 50)]
    policy = RetentionPolicy(keep_last=1, keep_every=20)
    assert _deleted(plan_prune(saves, policy, now=NOW)) == [10, 30]


def test_torn_saves_wait_for_the_grace_period():
    """A save without a manifest may be uploading: kept until older than grace_s."""
    saves = [_save(30), _save(40, age=5, committed=False), _save(20, age=700, committed=False)]
    decisions = plan_prune(saves, RetentionPolicy(keep_last=3, grace_s=600), now=NOW)
    assert _deleted(decisions) == [20]
    assert "no valid manifest" in decisions[0].reason


def test_torn_saves_do_not_count_towards_keep_last():
    """Corrupt newer saves never push the newest committed one out."""
    saves = [_save(50, committed=False), _save(40, committed=False), _save(30), _save(20)]
    decisions = plan_prune(saves, RetentionPolicy(keep_last=1, grace_s=60), now=NOW)
    assert _deleted(decisions) == [20, 40, 50]


def test_uploads_newer_than_the_pointer_are_kept():
    """A committed upload newer than the pointer may still be committed (UNKNOWN): never deleted."""
    saves = [_save(40, age=5), _save(35, age=900), _save(30), _save(20), _save(10)]
    decisions = plan_prune(saves, RetentionPolicy(keep_last=2, grace_s=600), now=NOW,
                           pointer=(30, _save(30).save_id))
    assert _deleted(decisions) == [10]


def test_pointer_moved_back_keeps_everything_up_to_the_high_water_step():
    """A new round resumed from 100 and committed 150: the intact step-200 save stays."""
    saves = [_save(200), _save(150), _save(100), _save(50)]
    decisions = plan_prune(saves, RetentionPolicy(keep_last=1, grace_s=0), now=NOW,
                           pointer=(150, _save(150).save_id), high_water=200)
    assert _deleted(decisions) == [50, 100]


def test_pointer_step_duplicate_from_a_zombie_is_removed_below_high_water():
    """Another save of the pointed step goes once it is below the high-water step."""
    live, zombie = _save(30, sid="0000000000030-aaaaaaaa"), _save(30, sid="0000000000031-bbbbbbbb")
    decisions = plan_prune([live, zombie], RetentionPolicy(keep_last=1, grace_s=0), now=NOW,
                           pointer=live.key, high_water=40)
    assert [d.save for d in decisions] == [zombie]
    assert plan_prune([live, zombie], RetentionPolicy(keep_last=1, grace_s=0), now=NOW,
                      pointer=live.key) == []


def test_same_step_older_copy_is_superseded():
    """Without a fence, two committed saves of one (not newest) step keep only the newer."""
    old, new = _save(30, age=100, sid="0000000000001-aaaaaaaa"), _save(30, age=50, sid="0000000000002-bbbbbbbb")
    decisions = plan_prune([old, new, _save(40)], RetentionPolicy(keep_last=3), now=NOW)
    assert [d.save for d in decisions] == [old]
    assert "superseded" in decisions[0].reason


def test_unreadable_and_foreign_saves_are_never_deleted():
    """A save that cannot be read, or another run's, stays however old and however many."""
    saves = [_save(40), _save(30), StoredSave(20, _save(20).save_id, 0.0, False, unreadable=True),
             StoredSave(10, _save(10).save_id, 0.0, True, foreign=True)]
    assert _deleted(plan_prune(saves, RetentionPolicy(keep_last=1, grace_s=0), now=NOW)) == [30]


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.booleans(), st.booleans(),
                             st.integers(0, 2000)), min_size=1, max_size=12),
    pointer_index=st.none() | st.integers(0, 11),
    extra_high=st.integers(0, 10),
    keep_last=st.integers(1, 4),
)
def test_never_deletes_what_may_be_committed(steps, pointer_index, extra_high, keep_last):
    """Property: no decision touches a committed save at/above high water or newer than the pointer."""
    saves = [StoredSave(step, f"{i:013d}-00000000", NOW - age, committed, unreadable=unr, foreign=fgn)
             for i, (step, committed, unr, fgn, age) in enumerate(steps)]
    pointer = high = None
    if pointer_index is not None and pointer_index < len(saves):
        pointer = saves[pointer_index].key
        high = pointer[0] + extra_high
    decisions = plan_prune(saves, RetentionPolicy(keep_last=keep_last, grace_s=600), now=NOW,
                           pointer=pointer, high_water=high)
    newest_own = max((s.step for s in saves if s.committed and not s.foreign and not s.unreadable),
                     default=-1)
    top = high if high is not None else newest_own
    for d in decisions:
        assert not d.save.unreadable and not d.save.foreign and d.save.key != pointer
        if d.save.committed and pointer is not None and d.save.step == pointer[0]:
            # Another complete save of the pointed step: the fence committed the pointed
            # one, so this one is a zombie or was refused (and is named so).
            assert "never committed by the fence" in d.reason
        elif d.save.committed:
            assert d.save.step < top
            assert pointer is None or d.save.step <= pointer[0]
        else:
            assert NOW - d.save.created_at > 600


def test_protected_saves_survive():
    """The save a process loaded is never deleted, however old."""
    saves = [_save(s) for s in (10, 20, 30)]
    decisions = plan_prune(saves, RetentionPolicy(keep_last=1), now=NOW, protect=frozenset({saves[0].key}))
    assert _deleted(decisions) == [20]


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": 0}, {"grace_s": -1}])
def test_bad_policy_values_are_refused(kwargs):
    """keep_last < 1 (would delete the newest), keep_every < 1 and negative grace are errors."""
    with pytest.raises(ValueError):
        RetentionPolicy(**kwargs)


_saves = st.lists(
    st.builds(lambda step, age, committed, n: StoredSave(step, f"{int(NOW - age):013d}-{n:08x}",
                                                         NOW - age, committed),
              st.integers(0, 30), st.floats(0, 2000), st.booleans(), st.integers(0, 3)),
    max_size=12, unique_by=lambda s: s.key)


@settings(max_examples=200, deadline=None)
@given(saves=_saves, keep_last=st.integers(1, 4), keep_every=st.none() | st.integers(1, 7),
       use_pointer=st.booleans())
def test_never_deletes_pointer_or_newest_committed(saves, keep_last, keep_every, use_pointer):
    """For any listing: the pointer and the newest committed save it allows always survive."""
    committed = [s for s in saves if s.committed]
    pointer = max(committed, key=lambda s: (s.step, s.created_at)).key if use_pointer and committed else None
    decisions = plan_prune(saves, RetentionPolicy(keep_last, keep_every, grace_s=600), now=NOW,
                           pointer=pointer)
    deleted = {d.save.key for d in decisions}
    assert pointer not in deleted
    allowed = [s for s in committed if pointer is None or s.step < pointer[0] or s.key == pointer]
    if allowed:
        newest = max(allowed, key=lambda s: (s.step, s.created_at, s.save_id))
        assert newest.key not in deleted
    young_torn = {s.key for s in saves if not s.committed and NOW - s.created_at <= 600}
    assert not deleted & young_torn
