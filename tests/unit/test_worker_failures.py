"""Which failures are a peer's death and which a stale group's: by type first, the text
fallback pinned per backend with a message it printed."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elasticd.worker.failures import (
    FailureText,
    failure_text,
    is_peer_failure,
    peer_failure_text,
    stale_group_error,
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


# torch: what distributed_c10d raised for a group destroyed and then used (torch 2.13).
STALE = ("Group <torch.distributed.distributed_c10d.ProcessGroup object at 0x7f3a2c1d5e30> is not "
         "initialized in the world group map. Please initialize the group first.")


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


def test_torch_refusing_a_destroyed_group_is_a_stale_group_not_a_peer_failure():
    """torch's ValueError for a destroyed group is a stale handle (the loop rebuilds its
    wrapper), never a peer's death; the same words in another type are not read."""
    assert failure_text(STALE) is FailureText.STALE_GROUP
    assert stale_group_error(ValueError(STALE))
    assert not is_peer_failure(ValueError(STALE)) and not is_peer_failure(RuntimeError(STALE))
    assert not stale_group_error(RuntimeError(STALE))
    assert not stale_group_error(ValueError("Connection closed by peer"))


def test_unknown_text_matches_nothing():
    """A message no backend printed is no known failure."""
    assert failure_text("mat1 and mat2 shapes cannot be multiplied") is None
