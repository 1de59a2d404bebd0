"""The job's progress history: a bounded series of samples in one etcd key, for pictures.

``/elasticd/<job>/progress`` holds only the newest progress; ``elasticd status --plot``
draws the job over time (world size, steps/s, loss, checkpoints), so the agent that
publishes progress also appends a sample to ``/elasticd/<job>/history``.

Why one key and why it halves: etcd must stay small for a job that runs for weeks
(DESIGN 6). The record holds at most ``MAX_SAMPLES`` samples taken at least
``interval_s`` apart. When it is full, every other sample is dropped (the newest is kept)
and ``interval_s`` doubles, so the record always covers the whole job, at a resolution
that coarsens with its age: 512 samples are 43 minutes at 5 s, 2 weeks at 40-80 min. Its
size is bounded (~35 KB), and writes get rarer as the job ages. A sample whose world size
differs from the previous one is taken at once (a resize is what the picture is for).

The record is validated on read like every record in etcd (DESIGN 12): a malformed one
raises ``ValueError`` and the writer starts a fresh history rather than crash.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any

from elasticd import codec

MAX_SAMPLES = 512
# A full record is ~35 KB; anything much larger is not one this module wrote.
MAX_RECORD_BYTES = 256 * 1024
MIN_INTERVAL_S = 5.0
FORMAT_VERSION = 1
# Column order of a row in the JSON record (rows, not objects: ~60-70 bytes a sample).
FIELDS = ("t", "step", "world_size", "samples_per_s", "round", "loss", "checkpoint_step", "step_s")


@dataclass(frozen=True)
class Sample:
    """One point of the job's history.

    ``t`` is Unix seconds; ``samples_per_s`` the rate the progress record published;
    ``loss`` the workers' last reported loss (None when workers report none);
    ``checkpoint_step`` the newest committed checkpoint's step at ``t`` (None: none yet);
    ``step_s`` the workers' median seconds per step of their latest steps at the previous
    sample's world size, the size the interval this sample closes held (None: not
    measured; records written before it have no such column): the goodput ledger's
    healthy step time.
    """

    t: float
    step: int
    world_size: int
    samples_per_s: float = 0.0
    round: int = -1
    loss: float | None = None
    checkpoint_step: int | None = None
    step_s: float | None = None

    def row(self) -> list[Any]:
        return [round(self.t, 3), self.step, self.world_size, round(self.samples_per_s, 3),
                self.round, None if self.loss is None else float(f"{self.loss:.6g}"),
                self.checkpoint_step, None if self.step_s is None else float(f"{self.step_s:.4g}")]


@dataclass(frozen=True)
class History:
    """``/elasticd/<job>/history``: samples oldest first, at least ``interval_s`` apart."""

    interval_s: float = MIN_INTERVAL_S
    samples: tuple[Sample, ...] = ()

    def to_json(self) -> str:
        # The step_s column only once a sample has one: a record of workers that measure
        # no step time is written as before it existed (byte for byte).
        n = len(FIELDS) if any(s.step_s is not None for s in self.samples) else len(FIELDS) - 1
        return json.dumps({"v": FORMAT_VERSION, "interval_s": self.interval_s,
                           "fields": list(FIELDS[:n]), "rows": [s.row()[:n] for s in self.samples]},
                          separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, data: bytes | str) -> History:
        """Parse and validate a history record (elasticd.codec reads the columns' types).

        Raises:
            ValueError: not JSON (or over the size or depth bound), an unknown version, or a
                row of the wrong shape or type (``codec.RecordDecodeError``, naming it).
        """
        raw = codec.decode(_HistoryRecord, data, what="history record", max_bytes=MAX_RECORD_BYTES)
        col = {name: i for i, name in enumerate(raw.fields)}
        if not {"t", "step", "world_size"} <= col.keys():
            raise codec.RecordDecodeError("history record.fields: missing t, step or world_size")
        return cls(raw.interval_s, tuple(_sample(row, col, i) for i, row in enumerate(raw.rows)))


Number = Annotated[float, codec.Finite()]


@dataclass(frozen=True)
class _HistoryRecord:
    """The wire form: columns named once in ``fields``, one row (a list) per sample."""

    v: Annotated[int, codec.Range(FORMAT_VERSION, FORMAT_VERSION + 1)]
    interval_s: Annotated[float, codec.Range(0, math.inf), codec.Finite()]
    fields: list[str]
    rows: list[list[Any]]

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or len(self.rows) > 4 * MAX_SAMPLES:
            raise ValueError(f"interval_s {self.interval_s} is not positive or {len(self.rows)} "
                             f"rows are more than {4 * MAX_SAMPLES}")


@dataclass(frozen=True)
class _Row:
    """One row's known columns (a column this elasticd does not know is ignored)."""

    t: Number
    step: Number
    world_size: Number
    samples_per_s: Number | None = None
    round: Number | None = None
    loss: Number | None = None
    checkpoint_step: Number | None = None
    step_s: Annotated[float, codec.Range(0, math.inf), codec.Finite()] | None = None


def _sample(row: list[Any], col: dict[str, int], n: int) -> Sample:
    known = {name: row[i] for name, i in col.items() if name in FIELDS and i < len(row)}
    r = codec.from_dict(_Row, known, what=f"history record.rows[{n}]")
    return Sample(t=r.t, step=int(r.step), world_size=int(r.world_size),
                  samples_per_s=0.0 if r.samples_per_s is None else r.samples_per_s,
                  round=-1 if r.round is None else int(r.round), loss=r.loss,
                  checkpoint_step=None if r.checkpoint_step is None else int(r.checkpoint_step),
                  step_s=r.step_s or None)


def append_sample(history: History, sample: Sample, *,
                  max_samples: int = MAX_SAMPLES) -> History | None:
    """The history with ``sample`` appended, or None when it is not due yet.

    A sample is due ``interval_s`` after the last one, or at once when the world size
    changed. Past ``max_samples`` every other sample is dropped, newest kept, and the
    interval doubles (see the module docstring).
    """
    last = history.samples[-1] if history.samples else None
    if last is not None:
        if sample.t <= last.t:
            return None  # a clock step back, or a writer behind another: keep time monotonic
        if sample.t - last.t < history.interval_s and sample.world_size == last.world_size:
            return None
    samples = (*history.samples, sample)
    interval = history.interval_s
    if len(samples) > max_samples:
        samples = samples[::-1][::2][::-1]
        interval *= 2
    return History(interval, samples)
