"""Manifest parsing and checkpoint names: storage is untrusted, every failure is a reason."""

from __future__ import annotations

import json

import pytest

from elasticd.checkpoint.api import CheckpointCorruptError
from elasticd.checkpoint.manifest import (
    FileEntry,
    Manifest,
    new_save_id,
    parse_save_id,
    parse_step_dir,
    step_dir_name,
)


def _manifest(**overrides) -> Manifest:
    fields = dict(job="demo", step=100, save_id="1700000000123-0a1b2c3d", world_size=4,
                  created_at=1700000000.123, committed_at=1700000001.0,
                  files=(FileEntry("state.pt", 1234, 0xDEADBEEF),), parts=("model", "optim"),
                  sampler={"epoch": 1, "samples_trained": 64})
    fields.update(overrides)
    return Manifest(**fields)


def _tampered(data: bytes, **changes) -> bytes:
    raw = json.loads(data)
    raw.update(changes)
    return json.dumps(raw).encode()


def test_manifest_round_trips_through_json():
    """A written manifest parses back to an equal record."""
    m = _manifest()
    assert Manifest.from_json(m.to_json()) == m
    assert m.total_bytes == 1234


def test_truncated_manifest_is_corrupt_with_reason():
    """A manifest cut short (torn write) is reported as invalid JSON, not a crash."""
    data = _manifest().to_json()
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        Manifest.from_json(data[: len(data) // 2])


def test_edited_manifest_fails_its_self_checksum():
    """A manifest that still parses but had a field changed (step 100 -> 900) is rejected."""
    data = _tampered(_manifest().to_json(), step=900)
    with pytest.raises(CheckpointCorruptError, match="self-checksum"):
        Manifest.from_json(data)


@pytest.mark.parametrize("name", ["../../other/state.pt", "a/b", "..", ".hidden", ""])
def test_manifest_file_names_cannot_escape_the_checkpoint_dir(name):
    """File names with a path, '..' or a leading dot are refused even with a valid checksum."""
    m = _manifest(files=(FileEntry(name, 1, 1),))
    with pytest.raises(CheckpointCorruptError, match="plain file name|field invalid"):
        Manifest.from_json(m.to_json())


def test_newer_format_version_is_refused_with_advice():
    """A manifest from a future format says which elasticd can read it."""
    raw = json.loads(_manifest().to_json())
    raw["format_version"] = 3
    with pytest.raises(CheckpointCorruptError, match="format_version 3 is not supported"):
        Manifest.from_json(json.dumps(raw).encode())


def test_boolean_step_is_not_an_int():
    """JSON true where an int belongs is corrupt, not step 1."""
    m = _manifest()
    raw = json.loads(m.to_json())
    raw.pop("manifest_crc32")
    raw["step"] = True
    # Re-sign it so only the type check can catch it.
    from elasticd.checkpoint.manifest import _canonical, checksum

    raw["manifest_crc32"] = f"{checksum(_canonical(raw)):08x}"
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.step: expected int, got a boolean"):
        Manifest.from_json(json.dumps(raw).encode())


def test_oversized_and_non_object_manifests_are_corrupt():
    """Huge manifests and JSON that is not an object are refused without parsing further."""
    with pytest.raises(CheckpointCorruptError, match="1 MiB"):
        Manifest.from_json(b" " * (2 << 20))
    with pytest.raises(CheckpointCorruptError, match="not a JSON object"):
        Manifest.from_json(b"[1, 2]")


def test_step_and_save_id_names_round_trip_and_reject_junk():
    """Directory names parse only in their exact form."""
    assert step_dir_name(7) == "step-000000000007"
    assert parse_step_dir("step-000000000007") == 7
    for junk in ("step-7", "step-00000000000x", "../step-000000000007", "step-0000000000071"):
        assert parse_step_dir(junk) is None
    sid = new_save_id(1700000000.5)
    assert parse_save_id(sid) == pytest.approx(1700000000.5)
    assert new_save_id(1.0) != new_save_id(1.0)
    assert parse_save_id("1700000000500-XYZ") is None
    with pytest.raises(ValueError):
        step_dir_name(-1)
    with pytest.raises(ValueError):
        step_dir_name(10**12)
