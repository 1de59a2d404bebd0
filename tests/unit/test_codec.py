"""The validating codec for typed records (elasticd.codec): field types are the schema."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import pytest

from elasticd import codec


class Kind(enum.Enum):
    JOIN = "join"
    LEAVE = "leave"


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    crc: int


@dataclass(frozen=True)
class Rec:
    kind: Kind
    step: int
    rate: float
    ok: bool
    boxes: list[Box]
    tags: dict[str, str] = field(default_factory=dict)
    note: str | None = None

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step {self.step} is negative")


def _rec() -> Rec:
    return Rec(Kind.LEAVE, 7, 0.5, True, [Box((0, 4), 123)], {"a": "b"}, None)


@pytest.mark.timeout(10)
def test_a_record_round_trips_with_enums_nested_records_and_tuples():
    """encode/dumps then decode gives the same record: enums by value, tuples as lists."""
    line = codec.dumps(_rec())
    assert b'"kind":"leave"' in line and b'"offsets":[0,4]' in line
    assert codec.decode(Rec, line, what="rec", max_bytes=1024) == _rec()


@pytest.mark.timeout(10)
def test_defaults_fill_absent_fields_unknown_keys_are_ignored_and_ints_are_floats():
    """A field with a default may be absent; a key a newer writer added is ignored; an
    int where a float is expected is taken as a float."""
    got = codec.decode(Rec, b'{"kind":"join","step":1,"rate":2,"ok":false,"boxes":[],"new":1}',
                       what="rec", max_bytes=1024)
    assert got == Rec(Kind.JOIN, 1, 2.0, False, [], {}, None) and isinstance(got.rate, float)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("text", "error"), [
    (b'{"kind":"crash","step":1,"rate":1,"ok":true,"boxes":[]}',
     r"rec\.kind: 'crash' is not one of 'join', 'leave'"),
    (b'{"kind":"join","step":true,"rate":1,"ok":true,"boxes":[]}', r"rec\.step: expected int, got a boolean"),
    (b'{"kind":"join","step":1,"rate":1,"ok":1,"boxes":[]}', r"rec\.ok: expected bool, got a number"),
    (b'{"kind":"join","step":1,"rate":1,"ok":true,"boxes":[{"offsets":["x"],"crc":1}]}',
     r"rec\.boxes\[0\]\.offsets\[0\]: expected int, got a string"),
    (b'{"kind":"join","step":1,"rate":1,"ok":true}', r"rec: field 'boxes' is missing"),
    (b'{"kind":"join","step":-1,"rate":1,"ok":true,"boxes":[]}', r"rec: step -1 is negative"),
    (b'{"kind":"join","step":1,"rate":1,"ok":true,"boxes":[],"note":3}', r"rec\.note: expected str"),
    (b'[1]', r"not an object"),
    (b'{"kind":"join","step":1,"rate":1,"ok":true,"boxes":[],"note":"' + b"x" * 2000 + b'"}', r"rec"),
])
def test_a_bad_record_is_refused_naming_the_field(text, error):
    """Every refusal is a RecordDecodeError (a ValueError) naming the record and field:
    an unknown enum value, a bool for an int, a wrong nested type, a missing field, the
    record's own check, a non-object, an oversized text."""
    with pytest.raises(codec.RecordDecodeError, match=error) as info:
        codec.decode(Rec, text, what="rec", max_bytes=1024)
    assert isinstance(info.value, ValueError)
