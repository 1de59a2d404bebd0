"""Typed parts of an etcd transaction: the compares that guard it and the operations it runs.

Callers describe a transaction with these frozen values and ``EtcdClient.txn`` turns them
into python3-etcd3's objects; no module but ``elasticd.etcd`` builds those. A fence
(the node's incarnation, the round state's revision) is then a plain list of values that
can be logged, compared in tests and passed around without a client at hand.

Revision semantics are etcd's: a key that does not exist has mod_revision and
create_revision 0, so ``ModRevision(key, 0)`` means "only if ``key`` is absent".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import etcd3.utils


@dataclass(frozen=True)
class ModRevision:
    """Compare: ``key`` was last written at ``revision`` (0: the key does not exist)."""

    key: str
    revision: int


@dataclass(frozen=True)
class CreateRevision:
    """Compare: ``key`` was created at ``revision``, i.e. it is still that incarnation."""

    key: str
    revision: int


@dataclass(frozen=True)
class Exists:
    """Compare: ``key`` exists (any incarnation)."""

    key: str


@dataclass(frozen=True)
class Put:
    """Operation: write ``value`` to ``key``, on ``lease`` when given."""

    key: str
    value: bytes | str
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    """Operation: delete ``key``."""

    key: str


@dataclass(frozen=True)
class DeletePrefix:
    """Operation: delete every key under ``prefix``."""

    prefix: str


@dataclass(frozen=True)
class DeleteRange:
    """Operation: delete every key in [start, end) (e.g. the per-round keys of old rounds)."""

    start: str
    end: str


@dataclass(frozen=True)
class Get:
    """Operation: read ``key`` at the transaction's revision (``EtcdClient.txn_read``
    returns it), e.g. a record's create_revision right after the put that made it."""

    key: str


Compare = ModRevision | CreateRevision | Exists
Op = Put | Delete | DeletePrefix | DeleteRange | Get


def raw_compare(t: Any, compare: Compare) -> Any:
    """python3-etcd3's compare for ``compare``, built with the ``Transactions`` factory ``t``."""
    if isinstance(compare, ModRevision):
        return t.mod(compare.key) == compare.revision
    if isinstance(compare, CreateRevision):
        return t.create(compare.key) == compare.revision
    if isinstance(compare, Exists):
        return t.version(compare.key) > 0
    raise TypeError(f"not an etcd compare: {compare!r}")


def raw_op(t: Any, op: Op) -> Any:
    """python3-etcd3's request for ``op``, built with the ``Transactions`` factory ``t``."""
    if isinstance(op, Put):
        return t.put(op.key, op.value, lease=op.lease)
    if isinstance(op, Delete):
        return t.delete(op.key)
    if isinstance(op, DeletePrefix):
        end = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(op.prefix))
        return t.delete(op.prefix, range_end=end)
    if isinstance(op, DeleteRange):
        return t.delete(op.start, range_end=etcd3.utils.to_bytes(op.end))
    if isinstance(op, Get):
        return t.get(op.key)
    raise TypeError(f"not an etcd operation: {op!r}")
