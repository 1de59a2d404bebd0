"""A state transfer over real sockets on 127.0.0.1 whose bytes are altered in flight (one
byte flipped by a relay between source and receiver) is refused before use."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace

import pytest
import torch

from elasticd.worker.transfer import TransferError, TransferSource, byte_view, receive

pytestmark = pytest.mark.timeout(60)


class FlippingRelay:
    """Forwards one connection source <-> receiver, flipping the byte at ``flip_at`` of the
    source's stream (None: forwards faithfully)."""

    def __init__(self, target: tuple[str, int], flip_at: int | None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target, self.flip_at = target, flip_at
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _pipe(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if flip and self.flip_at is not None and seen <= self.flip_at < seen + len(data):
                    buf = bytearray(data)
                    buf[self.flip_at - seen] ^= 0x01
                    data = bytes(buf)
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        up = socket.create_connection(self.target)
        back = threading.Thread(target=self._pipe, args=(up, conn, True), daemon=True)
        back.start()
        self._pipe(conn, up, False)
        back.join(10)
        conn.close()
        up.close()
        self.listener.close()


def _transfer(flip_at: int | None) -> tuple[torch.Tensor, torch.Tensor, BaseException | None,
                                            BaseException | None]:
    sent = torch.arange(4096, dtype=torch.float32)
    got = torch.zeros_like(sent)
    source = TransferSource("127.0.0.1", [byte_view(sent)])
    relay = FlippingRelay(("127.0.0.1", source.ticket.port), flip_at)
    errors: dict[str, BaseException] = {}

    def serve() -> None:
        try:
            source.serve([1], time.monotonic() + 20)
        except BaseException as exc:
            errors["source"] = exc

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        receive(replace(source.ticket, port=relay.port), 1, [byte_view(got)], time.monotonic() + 20)
    except TransferError as exc:
        errors["receiver"] = exc
    th.join(25)
    relay.thread.join(10)
    return sent, got, errors.get("receiver"), errors.get("source")


def test_a_byte_flipped_in_flight_is_refused_by_the_receiver():
    """One flipped payload byte: the receiver raises a TransferError naming the corruption
    (the caller falls back to the next tier), and the source learns the transfer failed."""
    header = 4 + 32 + 8 + 4  # the source's HEADER precedes the payload
    _, _, receiver_error, source_error = _transfer(flip_at=header + 1000)
    assert receiver_error is not None and "arrived corrupt" in str(receiver_error)
    assert "falling back" in str(receiver_error)
    assert isinstance(source_error, TransferError), "the source took a refused transfer as done"


def test_a_faithful_relay_delivers_the_state():
    """Control: the same relay without a flip delivers every byte and both sides succeed."""
    sent, got, receiver_error, source_error = _transfer(flip_at=None)
    assert receiver_error is None and source_error is None
    assert torch.equal(sent, got)
