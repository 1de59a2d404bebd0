"""The process-group lifecycle's decisions: which lifecycle a worker uses (failures:
tests/unit/test_worker_failures.py)."""

from __future__ import annotations

import pytest

from elasticd.worker.process_group import (
    LifecycleKind,
    assign_init_ranks,
    choose_lifecycle,
    torch_version,
)

pytestmark = pytest.mark.timeout(10)

def test_torch_versions_parse_with_local_tags():
    """Release, local and pre-release versions give (major, minor)."""
    assert torch_version("2.13.0+cpu") == (2, 13)
    assert torch_version("2.14.1") == (2, 14)
    assert torch_version("2.15.0a0+git1234") == (2, 15)


def test_gloo_reconfigures_in_place_from_torch_2_14_when_asked():
    """Asked for, gloo on 2.14+ with the API reconfigures; older torch, no API, or not
    asked for (the default) rebuilds."""
    assert choose_lifecycle((2, 14), "gloo", has_reconfigure=True, requested=True).kind is LifecycleKind.RECONFIGURE
    assert choose_lifecycle((2, 15), "gloo", has_reconfigure=True, requested=True).kind is LifecycleKind.RECONFIGURE
    old = choose_lifecycle((2, 13), "gloo", has_reconfigure=False, requested=True)
    assert old.kind is LifecycleKind.REBUILD and "2.13" in old.reason
    assert choose_lifecycle((2, 14), "gloo", has_reconfigure=False, requested=True).kind is LifecycleKind.REBUILD
    assert choose_lifecycle((2, 14), "gloo", has_reconfigure=True).kind is LifecycleKind.REBUILD


def test_nccl_reconfigures_only_behind_its_flag():
    """NCCL rebuilds even when reconfigure is asked for, unless nccl_reconfigure is on."""
    off = choose_lifecycle((2, 14), "nccl", has_reconfigure=True, requested=True)
    assert off.kind is LifecycleKind.REBUILD and "nccl" in off.reason
    on = choose_lifecycle((2, 14), "nccl", has_reconfigure=True, nccl_reconfigure=True)
    assert on.kind is LifecycleKind.RECONFIGURE




def test_init_ranks_are_kept_and_fresh_members_take_the_smallest_free():
    """Survivors keep their init rank for life; joiners, in rank order, fill the gaps."""
    assert assign_init_ranks([-1, -1]) == [0, 1]
    assert assign_init_ranks([1, -1, 3, -1]) == [1, 0, 3, 2]
    with pytest.raises(ValueError, match="held twice"):
        assign_init_ranks([2, 2])
