"""What etcd hands back: one key-value as read, one change as watched.

Plain frozen records, free of python3-etcd3 types, so the rest of elasticd (the
rendezvous view, ``elasticd status``) never touches the library's objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KV:
    """One key-value pair as read from etcd."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """A change to one key. ``value`` is None for deletions (including lease expiry)."""

    key: str
    value: bytes | None
    mod_revision: int


def kv_map(kvs: Iterable[KV]) -> dict[str, KV]:
    """Index key-values by key."""
    return {kv.key: kv for kv in kvs}
