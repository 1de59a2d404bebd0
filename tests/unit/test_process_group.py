"""The process-group lifecycle's decisions: which lifecycle a worker uses, and which
failures are a peer's death (by type first; one text fallback, pinned per backend)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elasticd.errors import ConfigError
from elasticd.worker.process_group import (
    LifecycleKind,
    LifecycleRequest,
    assign_init_ranks,
    choose_lifecycle,
    is_peer_failure,
    parse_lifecycle_request,
    peer_failure_text,
    torch_version,
)

pytestmark = pytest.mark.timeout(10)

# gloo: what torch 2.14.1 raised on this machine when a peer was SIGKILLed mid all-reduce
# (GLOO_RESET, verbatim) and gloo's other pair/buffer errors; NCCL: the wording of
# ProcessGroupNCCL's abort and remote-error messages (not observed here: no GPU run).
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
              "[127.0.0.1]:41528: Connection reset by peer")
GLOO_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:5"
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms"
NCCL_ABORTED = "NCCL communicator was aborted on rank 1."
NCCL_REMOTE = ("NCCL error in: ProcessGroupNCCL.cpp:2057, remote process exited or there was a network "
               "error, NCCL version 2.27.5 ncclRemoteError")


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


def test_peer_failures_are_recognised_by_type_first():
    """torch's DistError family and ConnectionError are a peer's death whatever they say."""
    assert is_peer_failure(dist.DistNetworkError("anything"))
    assert is_peer_failure(dist.DistBackendError("anything"))
    assert is_peer_failure(ConnectionResetError("anything"))
    assert not is_peer_failure(ValueError("Connection reset by peer"))  # not a backend's type


@pytest.mark.parametrize("text", [GLOO_RESET, GLOO_CLOSED, GLOO_TIMEOUT])
def test_gloo_peer_gone_text_is_recognised(text):
    """gloo raises a bare RuntimeError when a peer dies: its messages are matched."""
    assert peer_failure_text(text) == "gloo"
    assert is_peer_failure(RuntimeError(text))


@pytest.mark.parametrize("text", [NCCL_ABORTED, NCCL_REMOTE])
def test_nccl_peer_gone_text_is_recognised(text):
    """NCCL's abort and remote-error messages are matched when raised as a RuntimeError."""
    assert peer_failure_text(text) == "nccl"
    assert is_peer_failure(RuntimeError(text))


def test_a_script_bug_is_not_a_peer_failure():
    """A shape error, or a RuntimeError subclass that happens to mention a socket, re-raises."""
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert not is_peer_failure(NotImplementedError("socket"))


def test_init_ranks_are_kept_and_fresh_members_take_the_smallest_free():
    """Survivors keep their init rank for life; joiners, in rank order, fill the gaps."""
    assert assign_init_ranks([-1, -1]) == [0, 1]
    assert assign_init_ranks([1, -1, 3, -1]) == [1, 0, 3, 2]
    with pytest.raises(ValueError, match="held twice"):
        assign_init_ranks([2, 2])
