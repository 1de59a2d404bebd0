"""The state transports' pure parts: the pytree skeleton, where a receiver's own tensors
take the state, which transport carries it, and the collective's broadcast order."""

from __future__ import annotations

import collections
import pickle

import pytest
import torch

from elasticd.worker.transport.api import TensorMeta, TransferError, TransportKind, choose_transport
from elasticd.worker.transport.collective import BIG_TENSOR_BYTES, broadcast_plan
from elasticd.worker.transport.tree import (
    destinations,
    flatten_state,
    home_device,
    meta_of,
    unflatten_state,
)

Pair = collections.namedtuple("Pair", "left right")

CPU = torch.device("cpu")
GPU = torch.device("meta")  # stands in for a group device other than the CPU (no CUDA here)


def _state() -> dict:
    return {"model": collections.OrderedDict(w=torch.randn(2, 3), b=torch.zeros(3, dtype=torch.bfloat16)),
            "optim": {"state": {0: {"step": torch.tensor(4.0), "m": torch.ones(3)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
            "extra": [Pair(torch.tensor([True, False]), "x"), (None, 7), torch.arange(6).view(2, 3).t()]}


def test_the_skeleton_round_trips_every_container_and_pickles():
    """Dicts with int keys, ordered dicts, named tuples, tuples, None and values survive
    the split; the skeleton pickles; its metadata lists the tensors in their order."""
    sd = _state()
    skeleton, tensors = flatten_state(sd)
    skeleton = pickle.loads(pickle.dumps(skeleton))
    assert [(m.shape, m.dtype) for m in skeleton.metas()] == [(tuple(t.shape), t.dtype) for t in tensors]
    back = unflatten_state(skeleton, tensors)
    assert isinstance(back["model"], collections.OrderedDict) and list(back["model"]) == ["w", "b"]
    assert isinstance(back["extra"][0], Pair) and back["extra"][0].right == "x"
    assert back["extra"][1] == (None, 7) and back["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert torch.equal(back["optim"]["state"][0]["m"], torch.ones(3))
    assert back["extra"][2].data_ptr() == sd["extra"][2].data_ptr()  # the tensors, not copies


def test_putting_back_tensors_that_do_not_match_the_skeleton_raises():
    """A wrong count, shape or dtype is a TransferError, never a silently wrong state."""
    skeleton, tensors = flatten_state({"a": torch.zeros(2), "b": torch.zeros(3)})
    for bad in ([tensors[0]], tensors + [torch.zeros(1)], [tensors[0], torch.zeros(4)],
                [tensors[0], torch.zeros(3, dtype=torch.float64)]):
        with pytest.raises(TransferError):
            unflatten_state(skeleton, bad)


def test_a_receiver_takes_the_state_into_its_own_matching_tensors_only():
    """Same place, shape and dtype, contiguous, on the home device: received in place;
    anything else (other shape or dtype, non-contiguous, missing) gets fresh memory."""
    sent = {"m": {"w": torch.zeros(2, 3), "b": torch.zeros(3), "h": torch.zeros(4, 2), "n": torch.zeros(2)},
            "o": [torch.zeros(1, dtype=torch.int64), (torch.zeros(5), "x")], "gone": torch.zeros(1)}
    skeleton, _ = flatten_state(sent)
    own_w, own_tuple, own_int = torch.ones(2, 3), torch.ones(5), torch.ones(1, dtype=torch.int64)
    local = {"m": {"w": own_w, "b": torch.ones(4), "h": torch.ones(2, 4).t(),
                   "n": torch.ones(2, dtype=torch.float64)},
             "o": [own_int, (own_tuple, "x")]}
    got = destinations(skeleton, local, CPU)
    assert [t is not None for t in got] == [True, False, False, False, True, True, False]
    assert got[0].data_ptr() == own_w.data_ptr() and got[5].data_ptr() == own_tuple.data_ptr()
    assert destinations(skeleton, None, CPU) == [None] * 7


def test_a_tensor_shared_by_two_places_receives_only_once():
    """Tied weights (one tensor at two places) are a destination once; the second place
    is allocated, so two received tensors never write the same memory."""
    skeleton, _ = flatten_state({"embed": torch.zeros(4), "head": torch.zeros(4)})
    tied = torch.ones(4)
    got = destinations(skeleton, {"embed": tied, "head": tied}, CPU)
    assert got[0] is not None and got[0].data_ptr() == tied.data_ptr() and got[1] is None


def test_a_tensor_is_received_in_place_only_on_its_home_device():
    """A CPU tensor of the source stays on the CPU; any other lands on the group device:
    a receiver's tensor elsewhere is not a destination."""
    cuda_like = TensorMeta(shape=(2,), dtype=torch.float32, device_type="cuda")
    assert home_device(cuda_like, GPU) == GPU and home_device(meta_of(torch.zeros(2)), GPU) == CPU
    skeleton, _ = flatten_state({"w": torch.zeros(2, device="meta"), "step": torch.zeros(())})
    on_group, on_cpu = torch.empty(2, device="meta"), torch.zeros(())
    assert [t is not None for t in destinations(skeleton, {"w": on_group, "step": on_cpu}, GPU)] == [True, True]
    assert destinations(skeleton, {"w": torch.zeros(2), "step": on_cpu}, GPU)[0] is None
    assert destinations(skeleton, {"w": on_group, "step": on_cpu}, CPU)[0] is None


@pytest.mark.parametrize("requested, backend, device, tensors, expected", [
    (None, "gloo", CPU, [torch.zeros(2)], TransportKind.TCP),
    (None, "gloo", CPU, [torch.zeros(2), torch.zeros(2, device="meta")], TransportKind.COLLECTIVE),
    (None, "gloo", CPU, [torch.zeros(2).to_sparse()], TransportKind.COLLECTIVE),
    (None, "nccl", GPU, [torch.zeros(2, device="meta")], TransportKind.COLLECTIVE),
    (TransportKind.COLLECTIVE, "gloo", CPU, [torch.zeros(2)], TransportKind.COLLECTIVE),
    (TransportKind.TCP, "gloo", CPU, [torch.zeros(2)], TransportKind.TCP),
    (TransportKind.TCP, "nccl", GPU, [torch.zeros(2, device="meta")], None),
])
def test_the_transport_is_chosen_by_where_the_tensors_live(requested, backend, device, tensors, expected):
    """TCP for strided CPU tensors on gloo, the collective otherwise; TCP asked for tensors
    it cannot carry is refused, with a reason."""
    choice = choose_transport(requested, backend=backend, device=device, tensors=tensors)
    assert choice.kind is expected and choice.reason


def test_the_collective_sends_large_tensors_alone_and_small_ones_flat_per_dtype():
    """Both sides derive the same broadcast order from the metadata alone."""
    big = TensorMeta(shape=(BIG_TENSOR_BYTES // 4,), dtype=torch.float32, device_type="cpu")
    f32, i64 = (TensorMeta(shape=(3,), dtype=d, device_type="cpu") for d in (torch.float32, torch.int64))
    empty = TensorMeta(shape=(0, 4), dtype=torch.float32, device_type="cpu")
    assert broadcast_plan([f32, big, i64, big, empty, f32]) == ([1, 3], [[0, 4, 5], [2]])
    assert big.nbytes == BIG_TENSOR_BYTES and empty.numel == 0 and TensorMeta((), torch.bool, "cpu").nbytes == 1
