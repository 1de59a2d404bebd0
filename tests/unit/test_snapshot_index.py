"""One parser for a peer's snapshot index: the replica exchange and the in-memory reshard read it alike."""

from __future__ import annotations

import json

import pytest
import torch

from elasticd.checkpoint import shards
from elasticd.checkpoint.api import CheckpointCorruptError
from elasticd.worker.peer_replica import Snapshot, parse_snapshot, parse_snapshot_index


def _snapshot() -> Snapshot:
    data = torch.arange(8, dtype=torch.float32).view(torch.uint8)
    chunk = shards.Chunk("model/w", "float32", (8,), (0,), (8,), 0, int(data.numel()), 0, shards.data_name(1))
    return Snapshot(1, 6, [chunk], data, {"sampler": {"position": 3}})


@pytest.mark.timeout(30)
def test_an_index_round_trips_through_the_one_parser():
    """A snapshot's index parses back to its rank, step, chunks, size and extra state."""
    snap = _snapshot()
    assert parse_snapshot_index(snap.index()) == (1, 6, snap.chunks, int(snap.data.numel()), snap.extra)
    assert parse_snapshot(snap.index(), snap.data).chunks == snap.chunks


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raw", [
    b"not json",
    b"[1, 2]",
    b"[" * 100_000,
    json.dumps({"rank": 1, "step": 6}).encode(),
    b" " * (shards.MAX_INDEX_BYTES + 1) + b"{}",
], ids=["malformed", "not-an-object", "deeply-nested", "no-extra", "oversized"])
def test_a_bad_index_is_refused_as_corrupt_never_another_error(raw):
    """Malformed, nested, incomplete or oversized index bytes from a peer raise CheckpointCorruptError."""
    with pytest.raises(CheckpointCorruptError):
        parse_snapshot_index(raw)
