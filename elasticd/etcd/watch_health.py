"""Is a watch still delivering? The health decision for ``PrefixWatch``, as pure functions.

Why: a python3-etcd3 watch can go silent (no events, no error) after an etcd restart or
when etcd cancels it behind the client's back (soak: 2 of 51 runs). Nothing in the stream
says so. So every watch is checked end to end: a keys-only read of its range (the probe)
tells what etcd holds at some revision; every change it shows that the watch has not
delivered must arrive by the next probe. A change still missing one probe interval later
means the watch is silent, and it is re-created from its last delivered revision + 1 (no
change lost, none delivered twice).

A busy range does not look silent: what is judged at a probe is only what the *previous*
probe found missing, never what changed since.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WatchLag:
    """What a probe saw in etcd that the watch had not yet delivered.

    Attributes:
        revision: the watch must deliver up to this revision (0: no put missing).
        deleted: (key, mod_revision) pairs the watch still holds but etcd had deleted.
    """

    revision: int
    deleted: frozenset[tuple[str, int]]


@dataclass(frozen=True)
class WatchVerdict:
    """A probe's outcome: ``silent`` with its human-readable reason, and the lag to judge
    at the next probe (None: the watch had delivered everything the probe saw)."""

    silent: bool
    reason: str
    pending: WatchLag | None


def watch_lag(view: Mapping[str, int], delivered: int, probe: Mapping[str, int],
              probe_revision: int) -> WatchLag | None:
    """What ``probe`` (key -> mod_revision read at ``probe_revision``) holds that a watch
    with ``view`` (key -> mod_revision, as delivered) and ``delivered`` (last delivered
    revision) has not yet seen. Returns None if nothing."""
    missing_put = max((rev for rev in probe.values() if rev > delivered), default=0)
    deleted = frozenset((key, rev) for key, rev in view.items()
                        if key not in probe and rev <= probe_revision)
    if not missing_put and not deleted:
        return None
    return WatchLag(missing_put, deleted)


def lag_resolved(lag: WatchLag, view: Mapping[str, int], delivered: int) -> bool:
    """Whether the watch has since delivered everything ``lag`` named."""
    if delivered < lag.revision:
        return False
    return all(view.get(key) != rev for key, rev in lag.deleted)


def judge_watch(pending: WatchLag | None, view: Mapping[str, int], delivered: int,
                probe: Mapping[str, int], probe_revision: int) -> WatchVerdict:
    """One health check of a watch, after a successful probe.

    Args:
        pending: what the previous probe found undelivered (None: nothing).
        view: key -> mod_revision of every key the watch has delivered and not deleted.
        delivered: the last revision the watch delivered.
        probe, probe_revision: key -> mod_revision as etcd holds it, and the revision the
            probe was served at.

    Returns:
        ``silent`` if the previous probe's lag is still undelivered (re-create the watch),
        else the lag of this probe, to be judged at the next one.
    """
    if pending is not None and not lag_resolved(pending, view, delivered):
        missing = [f"changes up to revision {pending.revision}"] if delivered < pending.revision else []
        gone = sorted(key for key, rev in pending.deleted if view.get(key) == rev)
        missing += [f"the deletion of {gone}"] if gone else []
        reason = (f"etcd held {' and '.join(missing)} that the watch had not delivered one "
                  f"probe later (delivered up to revision {delivered})")
        return WatchVerdict(True, reason, None)
    lag = watch_lag(view, delivered, probe, probe_revision)
    return WatchVerdict(False, "caught up" if lag is None else "in flight", lag)
