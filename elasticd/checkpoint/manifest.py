"""Checkpoint names and the manifest record: the only things read from storage as JSON.

Everything here treats storage as untrusted: directory names are parsed with strict
regular expressions, file names in a manifest must be plain names (no ``/``, no ``..``),
and a manifest carries a CRC of its own canonical JSON so a flipped byte that still parses
is caught. Parsing never raises anything but :class:`CheckpointCorruptError` with a
one-line reason, which readers log before falling back to an older checkpoint.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from elasticd import boundedjson, codec
from elasticd.checkpoint.api import CheckpointCorruptError

FORMAT = "elasticd-checkpoint"
FORMAT_VERSION = 1
# Version 2: sharded (DTensor) state in per-rank shard files listed in ``shards``. Older
# elasticd refuses it by version instead of loading placeholders into a model.
SHARDED_FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
STATE_FILE = "state.pt"
# A manifest is a few KiB. Readers fetch at most this many bytes (plus one, to tell "too
# big" from "exactly the limit"), so a huge or hostile object never reaches memory whole.
MAX_MANIFEST_BYTES = 1 << 20

STEP_DIR_RE = re.compile(r"step-([0-9]{12})")  # fullmatch; ASCII digits only
SAVE_ID_RE = re.compile(r"([0-9]{13})-([0-9a-f]{8})")
# Run ids are born in the agent (or passed by the caller): 16 lowercase hex digits.
RUN_ID_RE = re.compile(r"[0-9a-f]{16}")  # fullmatch
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
MAX_STEP = 10**12 - 1


def step_dir_name(step: int) -> str:
    """``step-000000000100`` for step 100.

    Raises:
        ValueError: step is negative or has more than 12 digits.
    """
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"checkpoint step must be an int in [0, {MAX_STEP}], got {step!r}")
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-<12 digits>`` directory name, None for any other name."""
    m = STEP_DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def new_save_id(now: float) -> str:
    """A unique save id: ``<unix ms, 13 digits>-<8 random hex>``.

    The time prefix lets retention age a torn save without a stat call (whose fields
    differ between fsspec backends); the random suffix keeps two saves of one step (a
    zombie and the live job) in different directories, so their files never interleave.
    """
    return f"{int(now * 1000):013d}-{secrets.token_hex(4)}"


def parse_save_id(name: str) -> float | None:
    """The creation time (Unix seconds) encoded in a save id, None if ``name`` is not one."""
    m = SAVE_ID_RE.fullmatch(name)
    return int(m.group(1)) / 1000.0 if m else None


def checksum(data: Any, value: int = 0) -> int:
    """Running CRC-32 (zlib) of ``data``; continue with the previous ``value``."""
    return zlib.crc32(data, value)


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) matrix that takes a CRC-32 register past ``nbytes`` zero bytes (zlib's
    ``crc32_combine`` construction, by repeated squaring; cached per length)."""
    one_bit = (0xEDB88320,) + tuple(1 << n for n in range(31))
    power = one_bit
    for _ in range(3):  # one zero byte = 8 zero bits
        power = tuple(_gf2_times(power, power[n]) for n in range(32))
    result = tuple(1 << n for n in range(32))  # identity
    while nbytes:
        if nbytes & 1:
            result = tuple(_gf2_times(power, result[n]) for n in range(32))
        nbytes >>= 1
        if nbytes:
            power = tuple(_gf2_times(power, power[n]) for n in range(32))
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``: no pass over
    the bytes (a few microseconds once the operator for ``len2`` is cached)."""
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2 if len2 else crc1


def combine_blocks(crcs: Sequence[int], block: int, length: int) -> int:
    """The CRC-32 of ``length`` bytes from the CRCs of their ``block``-byte pieces."""
    whole = 0
    for i, crc in enumerate(crcs):
        whole = crc32_combine(whole, crc, min(block, length - i * block))
    return whole


def block_checksums(data: Any, block: int) -> tuple[list[int], int]:
    """CRC-32 of each ``block``-byte piece of ``data`` (the last may be shorter), and of
    all of it, in one pass over the bytes."""
    view = memoryview(data).cast("B")
    crcs = [zlib.crc32(view[i:i + block]) for i in range(0, view.nbytes, block)]
    return crcs, combine_blocks(crcs, block, view.nbytes)


@dataclass(frozen=True)
class FileEntry:
    """One data file of a checkpoint: plain name, size in bytes, CRC-32."""

    name: str
    size: int
    crc32: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "crc32": f"{self.crc32:08x}"}


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: what a checkpoint holds; written last, so it is the commit.

    Attributes:
        job: job name the checkpoint belongs to.
        step: training step.
        save_id: unique save id (equals the directory name).
        world_size: world size that saved it.
        created_at: Unix time the save started.
        committed_at: Unix time the manifest was written.
        files: every data file, exactly; nothing else in the directory is read.
        parts: top-level keys of the saved state (``model``, ``optim``...).
        sampler: the sampler state when it was JSON-serialisable (for inspection only;
            loading uses the copy in the data file).
        torch_version: torch that wrote it.
        elasticd_version: elasticd that wrote it.
        run_id: the run that wrote it ("" for an anonymous writer or a manifest written
            before run ids existed); a run loads and prunes only its own saves.
    """

    job: str
    step: int
    save_id: str
    world_size: int
    created_at: float
    committed_at: float
    files: tuple[FileEntry, ...]
    parts: tuple[str, ...] = ()
    sampler: dict[str, Any] | None = None
    torch_version: str = ""
    elasticd_version: str = ""
    run_id: str = ""
    shards: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Bytes of data the manifest lists."""
        return sum(f.size for f in self.files)

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": SHARDED_FORMAT_VERSION if self.shards else FORMAT_VERSION,
            "job": self.job,
            "step": self.step,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
            "files": [f.to_dict() for f in self.files],
            "parts": list(self.parts),
            "sampler": self.sampler,
            "torch_version": self.torch_version,
            "elasticd_version": self.elasticd_version,
            "run_id": self.run_id,
            **({"shards": list(self.shards)} if self.shards else {}),
        }

    def to_json(self) -> bytes:
        """Canonical JSON with a ``manifest_crc32`` of the rest appended."""
        body = self._body()
        body["manifest_crc32"] = f"{checksum(_canonical(body)):08x}"
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "manifest") -> Manifest:
        """Parse and verify a manifest.

        Args:
            data: the bytes read (at most ``MAX_MANIFEST_BYTES + 1`` of them).
            where: names the manifest (its path) in the size error.

        Raises:
            CheckpointCorruptError: over ``MAX_MANIFEST_BYTES``, not JSON, wrong format or
                version, a field missing or of the wrong type or range, an unsafe file
                name, or the self-checksum differs.
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise CheckpointCorruptError(
                f"{where} is over the {MAX_MANIFEST_BYTES >> 20} MiB manifest limit (not read "
                "further): not a manifest elasticd wrote; remove it or move it away")
        try:
            raw = boundedjson.loads(data, what="manifest", max_bytes=MAX_MANIFEST_BYTES)
        except boundedjson.BoundedJSONError as exc:
            raise CheckpointCorruptError(f"manifest is not valid JSON (truncated?) or not one "
                                         f"elasticd wrote: {exc}") from None
        if not isinstance(raw, dict):
            raise CheckpointCorruptError("manifest is not a JSON object")
        if raw.get("format") != FORMAT:
            raise CheckpointCorruptError(f"manifest format is {raw.get('format')!r}, not {FORMAT!r}")
        version = raw.get("format_version")
        if version not in (FORMAT_VERSION, SHARDED_FORMAT_VERSION):
            raise CheckpointCorruptError(
                f"manifest format_version {version!r} is not supported by this elasticd "
                f"(reads {FORMAT_VERSION} and {SHARDED_FORMAT_VERSION}); load it with the elasticd that wrote it"
            )
        stored_crc = raw.pop("manifest_crc32", None)
        if stored_crc != f"{checksum(_canonical(raw)):08x}":
            raise CheckpointCorruptError("manifest self-checksum does not match its content")
        try:
            rec = codec.from_dict(_ManifestRecord, raw, what="manifest")
        except codec.RecordDecodeError as exc:
            raise CheckpointCorruptError(f"manifest field invalid: {exc}") from None
        shards = (rec.shards or ()) if version == SHARDED_FORMAT_VERSION else ()
        if not shards and version == SHARDED_FORMAT_VERSION:
            raise CheckpointCorruptError("manifest field invalid: a sharded manifest lists no shard index")
        files = tuple(FileEntry(name=f.name, size=f.size, crc32=int(f.crc32, 16)) for f in rec.files)
        manifest = cls(job=rec.job, step=rec.step, save_id=rec.save_id, world_size=rec.world_size,
                       created_at=rec.created_at, committed_at=rec.committed_at, files=files,
                       parts=rec.parts, sampler=rec.sampler,
                       torch_version=rec.torch_version or "",
                       elasticd_version=rec.elasticd_version or "", run_id=rec.run_id or "",
                       shards=shards)
        if manifest.run_id and not RUN_ID_RE.fullmatch(manifest.run_id):
            raise CheckpointCorruptError(f"manifest run_id {manifest.run_id!r} is malformed")
        if not SAVE_ID_RE.fullmatch(manifest.save_id):
            raise CheckpointCorruptError(f"manifest save_id {manifest.save_id!r} is malformed")
        names = [f.name for f in files]
        if len(set(names)) != len(names) or MANIFEST_NAME in names:
            raise CheckpointCorruptError("manifest lists a file twice or lists itself")
        if not set(manifest.shards) <= set(names):
            raise CheckpointCorruptError("manifest names a shard index it does not list as a file")
        return manifest


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


UnixTime = Annotated[float, codec.Range(0, math.inf), codec.Finite()]


@dataclass(frozen=True)
class _FileRecord:
    """A ``files`` entry as written: the CRC-32 as 8 lowercase hex digits."""

    name: str
    size: Annotated[int, codec.Range(0, 1 << 62)]
    crc32: str

    def __post_init__(self) -> None:
        if not FILE_NAME_RE.fullmatch(self.name):
            # Names come from storage: anything but a plain file name could escape the
            # checkpoint directory (``../../other-job/...``) and is refused outright.
            raise ValueError(f"file name {self.name!r} is not a plain file name")
        if not re.fullmatch(r"[0-9a-f]{8}", self.crc32):
            raise ValueError(f"file {self.name!r} has a malformed crc32 {self.crc32!r}")


@dataclass(frozen=True)
class _ManifestRecord:
    """``manifest.json`` as written (``format``, ``format_version`` and ``manifest_crc32``
    are checked before it is decoded). Optional strings may be null (read as "")."""

    job: str
    step: Annotated[int, codec.Range(0, MAX_STEP, closed=True)]
    save_id: str
    world_size: Annotated[int, codec.Range(0, 1 << 24, closed=True)]
    created_at: UnixTime
    committed_at: UnixTime
    files: tuple[_FileRecord, ...]
    parts: tuple[str, ...]
    sampler: dict[str, Any] | None = None
    torch_version: str | None = None
    elasticd_version: str | None = None
    run_id: str | None = None
    shards: tuple[str, ...] | None = None
