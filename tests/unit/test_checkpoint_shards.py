"""Sharded checkpoint metadata: coverage is exact, indexes from storage are validated."""

from __future__ import annotations

import json

import pytest

from elasticd.checkpoint.api import CheckpointCorruptError
from elasticd.checkpoint.manifest import FileEntry, Manifest
from elasticd.checkpoint.shards import Chunk, check_coverage, index_json, parse_index
from elasticd.errors import ConfigError
from elasticd.worker.mesh import mesh_shape


def _chunk(offsets, sizes, file="shards-r00000.bin", shape=(4, 3), start=0):
    n = sizes[0] * sizes[1]
    return Chunk("state['model']['w']", "float64", shape, offsets, sizes, start, n * 8, 0, file)


def test_rows_split_over_ranks_cover_the_tensor_exactly_once():
    """Two disjoint boxes that add up to the shape pass; the chunks come back by tensor."""
    a, b = _chunk((0, 0), (3, 3)), _chunk((3, 0), (1, 3), "shards-r00001.bin")
    got = check_coverage([a, b], {"shards-r00000.bin": 72, "shards-r00001.bin": 24})
    assert got == {a.key: [a, b]}


def test_a_missing_shard_is_named_as_such():
    """Elements no box covers: the save is incomplete."""
    with pytest.raises(CheckpointCorruptError, match="cover 9 of 12 elements"):
        check_coverage([_chunk((0, 0), (3, 3))], {"shards-r00000.bin": 72})


def test_overlapping_boxes_are_refused_even_when_the_count_adds_up():
    """Two boxes storing the same rows (and together as many elements as the tensor) fail."""
    a, b = _chunk((0, 0), (2, 3)), _chunk((1, 0), (2, 3), "shards-r00001.bin")
    with pytest.raises(CheckpointCorruptError, match="overlap"):
        check_coverage([a, b, _chunk((3, 0), (0, 3), "shards-r00001.bin", start=48)],
                       {"shards-r00000.bin": 48, "shards-r00001.bin": 48})


def test_a_byte_range_past_its_file_is_corrupt():
    """An index pointing past the end of its data file (truncated) is caught."""
    with pytest.raises(CheckpointCorruptError, match="past the file"):
        check_coverage([_chunk((0, 0), (4, 3))], {"shards-r00000.bin": 50})


def test_index_round_trips_and_hostile_fields_are_refused():
    """What a rank writes parses back; an unknown dtype, a box outside its shape, a length
    that does not match the elements, or a renamed index are all corrupt."""
    chunk = _chunk((0, 0), (4, 3))
    data = index_json(0, [chunk], 96, 0xABCD)
    got, size, crc = parse_index(data, "shards-r00000.json")
    assert (got, size, crc) == ([chunk], 96, 0xABCD)
    with pytest.raises(CheckpointCorruptError, match="copied or tampered"):
        parse_index(data, "shards-r00001.json")
    for field, value in (("dtype", "object"), ("offsets", [3, 0]), ("length", 7)):
        raw = json.loads(data)
        raw["chunks"][0][field] = value
        with pytest.raises(CheckpointCorruptError):
            parse_index(json.dumps(raw).encode(), "shards-r00000.json")


def test_sharded_manifest_is_version_2_and_must_list_its_indexes():
    """A sharded manifest writes format_version 2 and round-trips its shard list."""
    files = (FileEntry("state.pt", 1, 0), FileEntry("shards-r00000.json", 2, 0))
    m = Manifest(job="j", step=1, save_id="1700000000000-0123abcd", world_size=1,
                 created_at=1.0, committed_at=2.0, files=files, shards=("shards-r00000.json",))
    assert json.loads(m.to_json())["format_version"] == 2
    assert Manifest.from_json(m.to_json()).shards == ("shards-r00000.json",)


def test_hsdp_mesh_is_nodes_by_processes_per_node():
    """hsdp: (nodes, processes per node), refused with the fix when nodes differ in size."""
    assert mesh_shape("hsdp", 4, 2) == ((2, 2), ("replicate", "shard"))
    assert mesh_shape("fsdp", 3, 2) == ((3,), ("shard",))
    with pytest.raises(ConfigError, match="multiple of 2"):
        mesh_shape("hsdp", 3, 2)


def test_crc32_combine_and_block_checksums_agree_with_zlib():
    """The CRC of a concatenation from its parts' CRCs, and the per-block CRCs with the
    whole one from one pass, equal zlib's on the bytes, for odd lengths and block sizes."""
    import os
    import zlib

    from elasticd.checkpoint.manifest import block_checksums, crc32_combine

    for n, block in ((0, 7), (1, 7), (1000, 7), (65536, 4096), (3 * 65536 + 11, 65536)):
        data = os.urandom(n)
        crcs, whole = block_checksums(data, block)
        assert whole == zlib.crc32(data)
        assert crcs == [zlib.crc32(data[i:i + block]) for i in range(0, n, block)]
    a, b = os.urandom(100), os.urandom(333)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), 333) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b""), 0) == zlib.crc32(a)


def test_block_crcs_round_trip_and_malformed_ones_are_refused():
    """A box over one block gets its block CRCs from ``new_chunk``, which parse back and add
    up to its CRC; a wrong count, a bad block size or a bad hex string is corrupt, and a
    block CRC changed in a well-formed index is what ``blocks_agree`` catches."""
    import dataclasses

    import torch

    from elasticd.checkpoint import shards

    t = torch.arange(3 * 65536 // 8 + 5, dtype=torch.float64)
    chunk = shards.new_chunk("w", t.dtype, tuple(t.shape), (0,), tuple(t.shape), 0,
                             shards.tensor_bytes(t), "shards-r00000.bin")
    assert len(chunk.blocks) == 4 and chunk.block_bytes == shards.BLOCK_BYTES
    assert shards.blocks_agree(chunk)
    small = shards.new_chunk("b", t.dtype, (5,), (0,), (5,), 0, shards.tensor_bytes(t[:5]))
    assert small.blocks == () and "block_crc32" not in small.to_dict()
    data = index_json(0, [chunk], chunk.length, 0)
    assert parse_index(data, "shards-r00000.json")[0] == [chunk]
    for field, value in (("block_crc32", ["00000000"] * 3), ("block_bytes", 100),
                         ("block_bytes", True), ("block_crc32", ["xyz"] * 4)):
        raw = json.loads(data)
        raw["chunks"][0][field] = value
        with pytest.raises(CheckpointCorruptError, match="invalid"):
            parse_index(json.dumps(raw).encode(), "shards-r00000.json")
    tampered = dataclasses.replace(chunk, blocks=(chunk.blocks[0] ^ 1, *chunk.blocks[1:]))
    assert not shards.blocks_agree(tampered)
