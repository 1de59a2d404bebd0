"""The peer-RAM replica's sealed tickets (pure): what the open c10d store carries holds no
token, and a ticket not sealed with the round key, for another rank, step or refresh, or
claiming more bytes than the whole state is refused before anything is allocated."""

from __future__ import annotations

import json

import pytest
import torch

from elasticd.checkpoint import shards
from elasticd.worker.peer_replica import (
    ReplicaTicketError,
    Snapshot,
    open_ticket,
    seal_ticket,
    state_bytes,
    ticket_tokens,
)
from elasticd.worker.transfer import TransferTicket

KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))
PREFIX = "elasticd/peer/3/7"


def snapshot(rank: int = 1, step: int = 50, rows: int = 3) -> Snapshot:
    data = torch.zeros(rows * 4 * 8, dtype=torch.uint8)
    chunk = shards.Chunk("w", "float64", (6, 4), (rank * 3, 0), (rows, 4), 0, int(data.numel()), 7,
                         shards.data_name(rank))
    return Snapshot(rank, step, [chunk], data, {"samples": 8})


def sealed(snap: Snapshot, *, key: bytes = KEY, prefix: str = PREFIX, total: int | None = None,
           rank: int | None = None, step: int | None = None) -> bytes:
    recv, send = ticket_tokens(key, prefix, snap.rank)
    n = int(snap.data.numel()) if total is None else total
    t = TransferTicket("127.0.0.1", 4242, recv, send, n, 1)
    return seal_ticket(key, prefix, snap.rank if rank is None else rank,
                       snap.step if step is None else step, t, snap.index())


@pytest.mark.timeout(10)
def test_a_sealed_ticket_opens_with_the_key_and_carries_no_token():
    """Sealed and opened with the round key: the tokens are derived, never in the store value."""
    snap = snapshot()
    value = sealed(snap)
    ticket, empty = open_ticket(KEY, PREFIX, value, rank=1, step=50, max_bytes=6 * 4 * 8)
    assert (ticket.host, ticket.port, ticket.total_bytes) == ("127.0.0.1", 4242, 96)
    assert (ticket.recv_token, ticket.send_token) == ticket_tokens(KEY, PREFIX, 1)
    assert empty.rank == 1 and empty.step == 50 and empty.data.numel() == 96
    for token in ticket_tokens(KEY, PREFIX, 1):
        assert token not in value and token.hex().encode() not in value
    assert set(json.loads(value.partition(b"\n")[2])) == {
        "rank", "step", "host", "port", "total", "count", "index"}


@pytest.mark.timeout(10)
def test_forged_replayed_or_misdirected_tickets_are_refused():
    """Another key, an altered body, another refresh, rank or step, or a bare JSON ticket:
    ReplicaTicketError."""
    snap = snapshot()
    good = sealed(snap)
    cases = {
        "another key": sealed(snap, key=OTHER_KEY),
        "altered body": good.replace(b'"port": 4242', b'"port": 4243'),
        "another refresh": sealed(snap, prefix="elasticd/peer/3/6"),
        "bare json": good.partition(b"\n")[2],
        "not hex": b"zz\n" + good.partition(b"\n")[2],
    }
    for what, value in cases.items():
        with pytest.raises(ReplicaTicketError):
            open_ticket(KEY, PREFIX, value, rank=1, step=50, max_bytes=1 << 20)
        assert what
    with pytest.raises(ReplicaTicketError, match="not sealed"):  # rank 1's, read as rank 0's
        open_ticket(KEY, PREFIX, good, rank=0, step=50, max_bytes=1 << 20)
    with pytest.raises(ReplicaTicketError, match="expected rank 1"):  # rank 0's index inside
        open_ticket(KEY, PREFIX, sealed(snapshot(rank=0), rank=1), rank=1, step=50,
                    max_bytes=1 << 20)
    with pytest.raises(ReplicaTicketError, match="step 50, expected rank 1 at step 55"):
        open_ticket(KEY, PREFIX, good, rank=1, step=55, max_bytes=1 << 20)


@pytest.mark.timeout(10)
def test_sizes_are_bounded_before_allocation():
    """A total that disagrees with the index, or exceeds the whole state's bytes, is refused."""
    snap = snapshot()
    with pytest.raises(ReplicaTicketError, match="malformed"):
        open_ticket(KEY, PREFIX, sealed(snap, total=1 << 40), rank=1, step=50, max_bytes=1 << 50)
    with pytest.raises(ReplicaTicketError, match="at most 95 bytes"):
        open_ticket(KEY, PREFIX, sealed(snap), rank=1, step=50, max_bytes=95)
    assert state_bytes(snap.chunks) == 6 * 4 * 8


@pytest.mark.timeout(10)
def test_a_deep_or_escaped_quote_index_is_refused_quickly():
    """The ticket body goes through the bounded reader: an escaped-quote run is refused."""
    value = sealed(snapshot())
    mac, _, _ = value.partition(b"\n")
    with pytest.raises(ReplicaTicketError):
        open_ticket(KEY, PREFIX, mac + b"\n" + b'"' + b'\\"' * 32_000, rank=1, step=50,
                    max_bytes=1 << 20)
