"""The TCP state transfer's pure parts: framing, token checks, partial I/O bookkeeping,
zero-copy byte views (where a receiver's own tensors take the state:
tests/unit/test_state_transport.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elasticd.worker.transfer import (
    ACK,
    HEADER,
    TransferError,
    advance,
    byte_view,
    check_ack,
    check_header,
    check_hello,
    encode_ack,
    encode_header,
    encode_hello,
    new_ticket,
)


def _ticket():
    return new_ticket("127.0.0.1", 4242, [memoryview(bytearray(10)), memoryview(bytearray(6))])


def test_tickets_carry_fresh_tokens_and_the_sizes():
    """Each transfer gets two distinct random 32-byte tokens; sizes sum the views."""
    a, b = _ticket(), _ticket()
    assert len(a.recv_token) == len(a.send_token) == 32 and a.recv_token != a.send_token
    assert a.recv_token != b.recv_token and (a.total_bytes, a.count) == (16, 2)


def test_a_hello_with_the_receive_token_names_its_rank():
    """A member's hello is accepted and tells which receiver it is."""
    t = _ticket()
    assert check_hello(encode_hello(2, t.recv_token), t, [1, 2]) == 2


@pytest.mark.parametrize("hello, expected", [
    (lambda t: encode_hello(1, b"\0" * 32), "wrong token"),
    (lambda t: encode_hello(1, t.send_token), "wrong token"),  # the other token proves nothing
    (lambda t: b"HTTP" + encode_hello(1, t.recv_token)[4:], "bad magic"),
    (lambda t: encode_hello(3, t.recv_token), "not a receiver"),
    (lambda t: encode_hello(1, t.recv_token)[:-1], "hello of"),
])
def test_a_stranger_or_a_wrong_hello_is_refused(hello, expected):
    """Wrong token, a foreign protocol, a rank not expected, a short read: refused."""
    t = _ticket()
    with pytest.raises(TransferError, match=expected):
        check_hello(hello(t), t, [1, 2])


def test_the_header_proves_the_source_and_the_sizes():
    """A receiver accepts only the send token and the sizes of the published metadata."""
    t = _ticket()
    check_header(encode_header(t), t)
    other = _ticket()
    with pytest.raises(TransferError, match="did not prove"):
        check_header(encode_header(other), t)
    with pytest.raises(TransferError, match="refused us or died"):
        check_header(encode_header(t)[: HEADER.size - 3], t)
    lying = dataclasses.replace(t, total_bytes=17)
    with pytest.raises(TransferError, match="the metadata says"):
        check_header(encode_header(lying), t)


def test_the_ack_must_count_every_byte():
    """The source treats anything but an ack of all bytes as a failed transfer."""
    check_ack(encode_ack(16), 16)
    for bad in (encode_ack(15), b"", encode_ack(16)[: ACK.size - 1]):
        with pytest.raises(TransferError):
            check_ack(bad, 16)


def test_advance_drops_whole_views_and_slices_a_partial_one():
    """After a partial sendmsg/recvmsg_into the rest starts at the right byte."""
    a, b, c = (memoryview(bytes(range(i, i + 4))) for i in (0, 4, 8))
    rest = advance([a, b, c], 6)
    assert [bytes(v) for v in rest] == [bytes([6, 7]), bytes([8, 9, 10, 11])]
    assert advance([a, b], 8) == [] and [bytes(v) for v in advance([a], 0)] == [bytes(a)]


def test_byte_views_write_through_to_the_tensor_for_every_dtype():
    """Receiving into a byte view fills the tensor itself (no copy), bfloat16, bool and
    0-dim included; a non-contiguous source is copied, not misread."""
    for src in (torch.randn(3, 4, dtype=torch.float64), torch.randn(5).to(torch.bfloat16),
                torch.tensor([True, False, True]), torch.tensor(3.5), torch.zeros(0)):
        dst = torch.empty_like(src)
        view = byte_view(dst)
        view[:] = byte_view(src)
        assert torch.equal(dst, src) and view.nbytes == src.numel() * src.element_size()
    t = torch.arange(6.0).view(2, 3).t()
    assert bytes(byte_view(t)) == bytes(byte_view(t.contiguous()))
