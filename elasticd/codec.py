"""One validating codec for typed records: frozen dataclasses to JSON objects and back.

Why: every record elasticd reads from a peer, a file or etcd is untrusted (DESIGN.md
decision 12), and decoding one by hand (``int(raw["step"])``, ``Kind(raw["kind"])``) in
each module let the checks drift: a bool passed as an int, an unknown enum value raised
``ValueError`` with no field name, a hand-over line was a bare ``json.loads``. Here a
record's field types are its schema: :func:`decode` reads the JSON text through
:mod:`elasticd.boundedjson` (size and depth bounded before anything recursive runs) and
checks every field against its annotation, naming the record and the field in the error.

Supported field types: ``str``, ``int`` (not ``bool``), ``float`` (an int is accepted),
``bool``, an ``Enum`` (by value), a nested dataclass, ``list[T]``, ``tuple[T, ...]``,
``dict[str, T]``, ``dict[int, T]`` (keys written as decimal strings, as ``json`` does) and
``T | None``. Bounds ride on the type: ``Annotated[int, Range(0, 2**62)]``,
``Annotated[str, Length(4096)]``, ``Annotated[float, Finite()]``. A field with a default may be absent; unknown keys are
ignored (a newer writer may add fields). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

from elasticd import boundedjson

R = TypeVar("R")
_MAX_KEY_DIGITS = 20  # an int key longer than this is no rank or step (int() is quadratic)


@dataclass(frozen=True)
class Range:
    """A number field's bounds, for ``Annotated[int, Range(lo, hi)]``: ``lo <= v < hi``
    (``closed``: ``lo <= v <= hi``). NaN is outside every range."""

    lo: float
    hi: float
    closed: bool = False

    def check(self, value: float, where: str) -> None:
        inside = self.lo <= value <= self.hi if self.closed else self.lo <= value < self.hi
        if not inside:
            end = "]" if self.closed else ")"
            raise RecordDecodeError(f"{where}: {value!r} is outside [{self.lo}, {self.hi}{end}")


@dataclass(frozen=True)
class Finite:
    """A float field that must be finite, for ``Annotated[float, Finite()]`` (no NaN, no inf)."""

    def check(self, value: float, where: str) -> None:
        if not math.isfinite(value):
            raise RecordDecodeError(f"{where}: {value!r} is not a finite number")


@dataclass(frozen=True)
class Length:
    """A string field's length bounds, for ``Annotated[str, Length(4096)]``, ``Annotated[float, Finite()]``."""

    most: int
    least: int = 0

    def check(self, value: str, where: str) -> None:
        if not self.least <= len(value) <= self.most:
            raise RecordDecodeError(f"{where}: {len(value)} characters long "
                                    f"(at least {self.least}, at most {self.most})")


class RecordDecodeError(boundedjson.BoundedJSONError):
    """A record that is not valid JSON, over its bounds, or with a field of the wrong type.

    A ``ValueError`` (through ``BoundedJSONError``), so a caller's ``except ValueError``
    that skips or refuses a record handles it.
    """


def encode(record: object) -> dict[str, Any]:
    """A dataclass record as a JSON-ready dict (enums by value, tuples as lists)."""
    if not dataclasses.is_dataclass(record) or isinstance(record, type):
        raise TypeError(f"not a dataclass record: {record!r}")
    return {f.name: _plain(getattr(record, f.name)) for f in dataclasses.fields(record)}


def dumps(record: object) -> bytes:
    """:func:`encode` as compact JSON bytes."""
    return json.dumps(encode(record), separators=(",", ":")).encode()


def decode(cls: type[R], data: bytes | bytearray | memoryview | str, *, what: str,
           max_bytes: int) -> R:
    """Read one ``cls`` record from untrusted JSON text.

    Args:
        cls: a dataclass; its field annotations are the schema.
        data: the JSON text.
        what: how errors name the record ("hand-over line").
        max_bytes: the size bound.

    Raises:
        RecordDecodeError: not JSON, over a bound, not an object, or a field missing or of
            the wrong type (named).
    """
    try:
        raw = boundedjson.loads_object(data, what=what, max_bytes=max_bytes)
    except boundedjson.BoundedJSONError as exc:
        raise RecordDecodeError(str(exc)) from exc
    return from_dict(cls, raw, what=what)


def from_dict(cls: type[R], raw: object, *, what: str) -> R:
    """A ``cls`` record from an already-decoded JSON value (see :func:`decode`)."""
    return _value(cls, raw, what)  # type: ignore[no-any-return]


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@functools.cache
def _schema(cls: type) -> tuple[tuple[str, Any, bool, tuple[Range | Length | Finite, ...]], ...]:
    """(name, resolved type, required) of each init field. A pure function of the class,
    memoised: resolving string annotations (``get_type_hints``) cost ~10x the decode of a
    control message, which the agent reads every step from every worker."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints[f.name]
        bounds: tuple[Range | Length | Finite, ...] = ()
        if typing.get_origin(hint) is typing.Annotated:  # a field's own bounds: checked here
            hint, bounds = typing.get_args(hint)[0], _bounds(hint)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, hint, required, bounds))
    return tuple(out)


def _bounds(tp: Any) -> tuple[Range | Length | Finite, ...]:
    return tuple(b for b in tp.__metadata__ if isinstance(b, (Range, Length, Finite)))


def _record(cls: type, raw: object, where: str) -> Any:
    if not isinstance(raw, dict):
        raise RecordDecodeError(f"{where}: expected an object, got {_json_type(raw)}")
    kwargs: dict[str, Any] = {}
    for name, hint, required, bounds in _schema(cls):
        if name not in raw:
            if required:
                raise RecordDecodeError(f"{where}: field {name!r} is missing")
            continue
        value = _value(hint, raw[name], f"{where}.{name}")
        if value is not None:
            for bound in bounds:
                bound.check(value, f"{where}.{name}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # the record's own __post_init__ checks
        raise RecordDecodeError(f"{where}: {exc}") from exc


@functools.cache
def _parts(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """``(get_origin(tp), get_args(tp))``, memoised (types are hashable and immutable)."""
    return typing.get_origin(tp), typing.get_args(tp)


def _value(tp: Any, raw: object, where: str) -> Any:
    # The common case first and cheaply: a plain scalar of the right JSON type.
    if (tp is int or tp is str or tp is float) and type(raw) is tp:
        return raw
    origin, args = _parts(tp)
    if origin is typing.Annotated:
        value = _value(args[0], raw, where)
        if value is not None:
            for bound in _bounds(tp):
                bound.check(value, where)
        return value
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _value(rest[0], raw, where)
        raise TypeError(f"{where}: unions other than T | None are not supported")
    if origin is list:
        return [_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(_array(raw, where))]
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{where}: only tuple[T, ...] is supported")
        return tuple(_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(_array(raw, where)))
    if origin is dict:
        if not isinstance(raw, dict):
            raise RecordDecodeError(f"{where}: expected an object, got {_json_type(raw)}")
        return {_key(args[0], k, where): _value(args[1], v, f"{where}[{k!r}]")
                for k, v in raw.items()}
    if tp is Any:
        return raw
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _record(tp, raw, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(raw)
        except ValueError:
            known = ", ".join(repr(m.value) for m in tp)
            raise RecordDecodeError(f"{where}: {raw!r} is not one of {known}") from None
    if tp is bool:
        if isinstance(raw, bool):
            return raw
    elif tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
    elif tp is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
    elif tp is str:
        if isinstance(raw, str):
            return raw
    else:
        raise TypeError(f"{where}: field type {tp!r} is not supported by the codec")
    raise RecordDecodeError(f"{where}: expected {tp.__name__}, got {_json_type(raw)}")


def _key(tp: Any, key: str, where: str) -> str | int:
    if typing.get_origin(tp) is typing.Annotated:
        value = _key(typing.get_args(tp)[0], key, where)
        for bound in tp.__metadata__:
            if isinstance(bound, (Range, Length)):
                bound.check(value, f"{where} key {key!r}")  # type: ignore[arg-type]
        return value
    if tp is str:
        return key
    if tp is int:
        digits = key[1:] if key.startswith("-") else key
        if digits.isascii() and digits.isdigit() and len(digits) <= _MAX_KEY_DIGITS:
            return int(key)
        shown = key if len(key) <= 64 else key[:64] + "..."
        raise RecordDecodeError(f"{where}: key {shown!r} is not an integer")
    raise TypeError(f"{where}: dict keys of type {tp!r} are not supported by the codec")


def _array(raw: object, where: str) -> list[Any]:
    if not isinstance(raw, list):
        raise RecordDecodeError(f"{where}: expected an array, got {_json_type(raw)}")
    return raw


def _json_type(raw: object) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(raw), type(raw).__name__)
