"""Unit tests of the typed etcd transaction parts (elasticd.etcd.txn), against etcd3's own factory."""

from __future__ import annotations

import etcd3.etcdrpc as etcdrpc
import pytest
from etcd3.client import Transactions

from elasticd.etcd.txn import (
    CreateRevision,
    Delete,
    DeletePrefix,
    Exists,
    Get,
    ModRevision,
    Put,
    raw_compare,
    raw_op,
)

T = Transactions()


def test_compares_map_to_etcd_revision_compares():
    """ModRevision/CreateRevision become etcd's MOD/CREATE == compares on the same key and revision."""
    mod = raw_compare(T, ModRevision("/k", 7)).build_message()
    create = raw_compare(T, CreateRevision("/k", 3)).build_message()
    assert (mod.key, mod.target, mod.mod_revision, mod.result) == (
        b"/k", etcdrpc.Compare.MOD, 7, etcdrpc.Compare.EQUAL)
    assert (create.key, create.target, create.create_revision) == (b"/k", etcdrpc.Compare.CREATE, 3)
    exists = raw_compare(T, Exists("/k")).build_message()
    assert (exists.key, exists.target, exists.version, exists.result) == (
        b"/k", etcdrpc.Compare.VERSION, 0, etcdrpc.Compare.GREATER)


def test_ops_map_to_put_delete_and_prefix_delete():
    """Put keeps its lease; DeletePrefix deletes the whole range under the prefix."""
    put = raw_op(T, Put("/k", b"v", lease=42))
    assert (put.key, put.value, put.lease) == ("/k", b"v", 42)
    one = raw_op(T, Delete("/k"))
    assert one.key == "/k" and one.range_end is None
    rng = raw_op(T, DeletePrefix("/a/"))
    assert (rng.key, rng.range_end) == ("/a/", b"/a0")
    get = raw_op(T, Get("/k"))
    assert get.key == "/k" and get.range_end is None


def test_untyped_parts_are_refused():
    """An old-style lambda or a raw etcd3 object is a TypeError, not a silently wrong txn."""
    with pytest.raises(TypeError):
        raw_compare(T, lambda t: t.mod("/k") == 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        raw_op(T, ("put", "/k"))  # type: ignore[arg-type]
