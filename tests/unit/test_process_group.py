"""The process-group lifecycle's decisions: which lifecycle a worker uses (failures:
tests/unit/test_worker_failures.py)."""

from __future__ import annotations

import pytest

from elasticd.errors import ConfigError
from elasticd.worker.process_group import (
    LifecycleKind,
    LifecycleRequest,
    assign_init_ranks,
    choose_lifecycle,
    parse_lifecycle_request,
    torch_version,
)

pytestmark = pytest.mark.timeout(10)

def test_torch_versions_parse_with_local_tags():
    """Release, local and pre-release versions give (major, minor)."""
    assert torch_version("2.13.0+cpu") == (2, 13)
    assert torch_version("2.14.1") == (2, 14)
    assert torch_version("2.15.0a0+git1234") == (2, 15)


def test_gloo_reconfigures_in_place_by_default_from_torch_2_14():
    """Unset, gloo on 2.14+ with the API reconfigures; older torch or no API rebuilds."""
    for version in ((2, 14), (2, 15)):
        choice = choose_lifecycle(version, "gloo", has_reconfigure=True)
        assert choice.kind is LifecycleKind.RECONFIGURE and "default" in choice.reason
    old = choose_lifecycle((2, 13), "gloo", has_reconfigure=False)
    assert old.kind is LifecycleKind.REBUILD and "2.13" in old.reason
    assert choose_lifecycle((2, 13), "gloo", has_reconfigure=True).kind is LifecycleKind.REBUILD
    assert choose_lifecycle((2, 14), "gloo", has_reconfigure=False).kind is LifecycleKind.REBUILD
    asked = choose_lifecycle((2, 14), "gloo", has_reconfigure=False, request=LifecycleRequest.RECONFIGURE)
    assert asked.kind is LifecycleKind.REBUILD  # asked for, but this torch has none


def test_rebuild_when_the_job_asks_for_it():
    """ELASTICD_GROUP_LIFECYCLE=rebuild opts out of reconfigure on every torch and backend."""
    for backend in ("gloo", "nccl"):
        choice = choose_lifecycle((2, 15), backend, has_reconfigure=True, request=LifecycleRequest.REBUILD)
        assert choice.kind is LifecycleKind.REBUILD and "asked" in choice.reason


def test_nccl_reconfigures_only_behind_its_flag():
    """NCCL rebuilds by default and when gloo's reconfigure is asked for; only
    nccl-reconfigure (experimental) reconfigures it."""
    for request in (LifecycleRequest.DEFAULT, LifecycleRequest.RECONFIGURE):
        off = choose_lifecycle((2, 14), "nccl", has_reconfigure=True, request=request)
        assert off.kind is LifecycleKind.REBUILD and "nccl" in off.reason
    on = choose_lifecycle((2, 14), "nccl", has_reconfigure=True, request=LifecycleRequest.NCCL_RECONFIGURE)
    assert on.kind is LifecycleKind.RECONFIGURE


@pytest.mark.parametrize(("value", "request_"), [
    (None, LifecycleRequest.DEFAULT), ("", LifecycleRequest.DEFAULT),
    ("rebuild", LifecycleRequest.REBUILD), ("reconfigure", LifecycleRequest.RECONFIGURE),
    ("nccl-reconfigure", LifecycleRequest.NCCL_RECONFIGURE)])
def test_lifecycle_requests_parse(value, request_):
    """Every ELASTICD_GROUP_LIFECYCLE value maps to its request; unset is the default."""
    assert parse_lifecycle_request(value) is request_


def test_an_unknown_lifecycle_request_is_a_config_error():
    """A misspelt ELASTICD_GROUP_LIFECYCLE is a config error naming the value and the choices."""
    with pytest.raises(ConfigError, match="recnfigure.*rebuild, reconfigure, nccl-reconfigure"):
        parse_lifecycle_request("recnfigure")



def test_init_ranks_are_kept_and_fresh_members_take_the_smallest_free():
    """Survivors keep their init rank for life; joiners, in rank order, fill the gaps."""
    assert assign_init_ranks([-1, -1]) == [0, 1]
    assert assign_init_ranks([1, -1, 3, -1]) == [1, 0, 3, 2]
    with pytest.raises(ValueError, match="held twice"):
        assign_init_ranks([2, 2])
