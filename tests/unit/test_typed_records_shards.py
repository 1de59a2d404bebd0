"""The shard indexes through the one validating codec: an index written before it still
reads (on disk and from a peer), and a malformed one is refused naming the field.

The modules are imported at collection (they import torch: seconds on a loaded machine)."""

from __future__ import annotations

import json

import pytest

from elasticd.checkpoint.api import CheckpointCorruptError
from elasticd.checkpoint.shards import Chunk, index_json, parse_index
from elasticd.worker.peer_replica import parse_snapshot_index as parse_peer


def _deep(levels: int) -> list[object]:
    out: list[object] = []
    for _ in range(levels - 1):
        out = [out]
    return out


# Written by main before the codec (d17aa79: shards.index_json).
OLD_SHARD_INDEX = (
    b'{"chunks": [{"crc32": "0badf00d", "dtype": "float32", "key": "model.w", "length": 24, "offsets": '
    b'[2, 0], "shape": [4, 3], "sizes": [2, 3], "start": 0}, {"block_bytes": 4096, "block_crc32": '
    b'["00000001", "00000002", "00000003", "00000004"], "crc32": "12345678", "dtype": "float32", "key": '
    b'"model.b", "length": 16384, "offsets": [0], "shape": [4096], "sizes": [4096], "start": 24}], '
    b'"data": "shards-r00001.bin", "data_crc32": "cafebabe", "data_size": 16408, "format": '
    b'"elasticd-shards", "rank": 1}')


def _old_chunks() -> list[Chunk]:
    return [Chunk("model.w", "float32", (4, 3), (2, 0), (2, 3), 0, 24, 0x0BADF00D, "shards-r00001.bin"),
            Chunk("model.b", "float32", (4096,), (0,), (4096,), 24, 16384, 0x12345678,
                  "shards-r00001.bin", 4096, (1, 2, 3, 4))]


@pytest.mark.timeout(10)
def test_a_shard_index_written_by_the_old_writer_reads_on_disk_and_from_a_peer():
    """A rank's ``shards-r00001.json`` as main wrote it reads to the same chunks, size and
    CRC, is written back byte for byte, and the same index with a peer's step and extra
    state reads through the worker's parser."""
    chunks, size, crc = parse_index(OLD_SHARD_INDEX, "shards-r00001.json")
    assert (chunks, size, crc) == (_old_chunks(), 16408, 0xCAFEBABE)
    assert index_json(1, chunks, size, crc) == OLD_SHARD_INDEX
    peer = json.dumps({**json.loads(OLD_SHARD_INDEX), "step": 12, "extra": {"rng": {}}}).encode()
    assert parse_peer(peer) == (1, 12, _old_chunks(), 16408, {"rng": {}})


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("edit", "error"), [
    ({"data_size": True}, r"shard index shards-r00001\.json\.data_size: expected int, got a boolean"),
    ({"data_crc32": 5}, r"\.data_crc32: expected str, got a number"),
    ({"chunks": [{"key": "w", "dtype": "float32", "shape": [2], "offsets": [0], "sizes": [2],
                  "start": 0, "length": 8, "crc32": "0badf00d", "extra": 1}, {"key": 1}]},
     r"\.chunks\[1\]\.key: expected str, got a number"),
    ({"chunks": [{"key": "w", "dtype": "float33", "shape": [2], "offsets": [0], "sizes": [2],
                  "start": 0, "length": 8, "crc32": "0badf00d"}]}, r"\.chunks\[0\]: dtype 'float33'"),
    ({"chunks": [{"key": "w", "dtype": "float32", "shape": [2], "offsets": [-1], "sizes": [2],
                  "start": 0, "length": 8, "crc32": "0badf00d"}]}, r"\.chunks\[0\]\.offsets\[0\]: -1 is outside"),
    ({"chunks": [{"key": "w", "dtype": "float32", "shape": [2], "offsets": [0], "sizes": [2],
                  "start": 0, "length": 8, "crc32": "0badf00d", "block_bytes": 4096,
                  "block_crc32": [False]}]}, r"\.chunks\[0\]\.block_crc32\[0\]: expected str, got a boolean"),
])
def test_a_malformed_shard_index_is_refused_naming_the_field(edit, error):
    """An index with a bool size, a numeric CRC, a non-string key, an unknown dtype, a
    negative offset or a bool block CRC is CheckpointCorruptError naming the field."""
    raw = {**json.loads(OLD_SHARD_INDEX), **edit}
    with pytest.raises(CheckpointCorruptError, match=error):
        parse_index(json.dumps(raw).encode(), "shards-r00001.json")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("edit", "error"), [
    ({"step": True}, r"a peer's shard index\.step: expected int, got a boolean"),
    ({"extra": []}, r"a peer's shard index\.extra: expected an object, got an array"),
    ({"rank": "1"}, r"a peer's shard index\.rank: expected int, got a string"),
    ({"pad": _deep(40)}, r"nest"),
])
def test_a_malformed_peer_index_is_refused_naming_the_field(edit, error):
    """A peer's in-memory index with a bool step, an array for its state, a string rank or
    deep JSON is CheckpointCorruptError naming the field (it was a bare ``json.loads``)."""
    raw = {**json.loads(OLD_SHARD_INDEX), "step": 12, "extra": {}, **edit}
    with pytest.raises(CheckpointCorruptError, match=error):
        parse_peer(json.dumps(raw).encode())
