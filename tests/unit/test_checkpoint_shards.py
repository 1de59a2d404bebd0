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


def _box(offsets, sizes, shape, file="shards-r00000.bin"):
    n = 1
    for s in sizes:
        n *= s
    return Chunk("w", "float32", shape, offsets, sizes, 0, n * 4, 0, file)


@pytest.mark.timeout(60)
def test_coverage_of_a_large_index_is_checked_in_n_log_n():
    """20,000 row boxes (and a 100 x 200 grid) are checked in well under a second of CPU
    (the all-pairs check took 64 s for 8,000); a duplicated cell is still an overlap."""
    import time

    rows = [_box((i, 0), (1, 4), (20_000, 4)) for i in range(20_000)]
    grid = [_box((i * 2, j * 3), (2, 3), (200, 600)) for i in range(100) for j in range(200)]
    start = time.process_time()
    assert len(check_coverage(rows, {"shards-r00000.bin": 16})["w"]) == 20_000
    assert len(check_coverage(grid, {"shards-r00000.bin": 24})["w"]) == 20_000
    assert time.process_time() - start < 1.0
    with pytest.raises(CheckpointCorruptError, match="overlap"):
        check_coverage([*grid[:-1], grid[0]], {"shards-r00000.bin": 24})


@pytest.mark.timeout(60)
def test_boxes_off_a_grid_are_swept_and_a_hostile_many_refused():
    """A tiling that is not one grid (strips across, strips down) passes; an overlap in one is
    found; 40,000 such strips are refused as too many to check, not checked for minutes."""
    import time

    def strips(n):  # n strips across the top half, n strips down the bottom half
        top = [_box((i, 0), (1, 2 * n), (2 * n, 2 * n)) for i in range(n)]
        bottom = [_box((n, 2 * j), (n, 2), (2 * n, 2 * n)) for j in range(n)]
        return top + bottom

    sizes = {"shards-r00000.bin": 1 << 30}
    assert len(check_coverage(strips(50), sizes)["w"]) == 100
    bad = strips(50)
    bad[-1] = _box((49, 98), (51, 2), (100, 100))  # reaches up into the last strip across
    with pytest.raises(CheckpointCorruptError, match="overlap"):
        check_coverage(bad, sizes)
    start = time.process_time()
    with pytest.raises(CheckpointCorruptError, match="too many to check"):
        check_coverage(strips(20_000), sizes)
    assert time.process_time() - start < 5.0


@pytest.mark.timeout(60)
def test_an_index_over_the_chunk_cap_is_refused_naming_the_cap():
    """A shard index listing more chunks than MAX_CHUNKS_PER_INDEX is corrupt, the cap named."""
    from elasticd.checkpoint.shards import MAX_CHUNKS_PER_INDEX

    chunk = json.loads(index_json(0, [_chunk((0, 0), (4, 3))], 96, 0))["chunks"][0]
    raw = json.loads(index_json(0, [], 96, 0))
    raw["chunks"] = [chunk] * (MAX_CHUNKS_PER_INDEX + 1)
    with pytest.raises(CheckpointCorruptError, match="MAX_CHUNKS_PER_INDEX"):
        parse_index(json.dumps(raw).encode(), "shards-r00000.json")
