"""The job's progress history: a bounded series of samples in one etcd key, for pictures.

``/elasticd/<job>/progress`` holds only the newest progress; ``elasticd status --plot``
draws the job over time (world size, steps/s, loss, checkpoints), so the agent that
publishes progress also appends a sample to ``/elasticd/<job>/history``.

Why one key and why it halves: etcd must stay small for a job that runs for weeks
(DESIGN 6). The record holds at most ``MAX_SAMPLES`` samples taken at least
``interval_s`` apart. When it is full, every other sample is dropped (the newest is kept)
and ``interval_s`` doubles, so the record always covers the whole job, at a resolution
that coarsens with its age: 512 samples are 43 minutes at 5 s, 2 weeks at 40-80 min. Its
size is bounded (~30 KB), and writes get rarer as the job ages. A sample whose world size
differs from the previous one is taken at once (a resize is what the picture is for).

The record is validated on read like every record in etcd (DESIGN 12): a malformed one
raises ``ValueError`` and the writer starts a fresh history rather than crash.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from elasticd import boundedjson

MAX_SAMPLES = 512
# A full record is ~30 KB; anything much larger is not one this module wrote.
MAX_RECORD_BYTES = 256 * 1024
MIN_INTERVAL_S = 5.0
FORMAT_VERSION = 1
# Column order of a row in the JSON record (rows, not objects: ~60 bytes a sample).
FIELDS = ("t", "step", "world_size", "samples_per_s", "round", "loss", "checkpoint_step")


@dataclass(frozen=True)
class Sample:
    """One point of the job's history.

    ``t`` is Unix seconds; ``samples_per_s`` the rate the progress record published;
    ``loss`` the workers' last reported loss (None when workers report none);
    ``checkpoint_step`` the newest committed checkpoint's step at ``t`` (None: none yet).
    """

    t: float
    step: int
    world_size: int
    samples_per_s: float = 0.0
    round: int = -1
    loss: float | None = None
    checkpoint_step: int | None = None

    def row(self) -> list[Any]:
        return [round(self.t, 3), self.step, self.world_size, round(self.samples_per_s, 3),
                self.round, None if self.loss is None else float(f"{self.loss:.6g}"),
                self.checkpoint_step]


@dataclass(frozen=True)
class History:
    """``/elasticd/<job>/history``: samples oldest first, at least ``interval_s`` apart."""

    interval_s: float = MIN_INTERVAL_S
    samples: tuple[Sample, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"v": FORMAT_VERSION, "interval_s": self.interval_s,
                           "fields": list(FIELDS), "rows": [s.row() for s in self.samples]},
                          separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, data: bytes | str) -> History:
        """Parse and validate a history record.

        Raises:
            ValueError: not JSON (or over the size or depth bound: ``BoundedJSONError``), an
                unknown version, or a row of the wrong shape or type.
        """
        raw = boundedjson.loads_object(data, what="history record", max_bytes=MAX_RECORD_BYTES)
        if raw.get("v") != FORMAT_VERSION:
            raise ValueError("history record: not a version-1 object")
        interval: Any = raw.get("interval_s")
        fields = raw.get("fields")
        rows = raw.get("rows")
        if not _is_num(interval) or interval <= 0 or not isinstance(rows, list) \
                or not isinstance(fields, list) or len(rows) > 4 * MAX_SAMPLES:
            raise ValueError("history record: bad interval_s, fields or rows")
        col = {name: i for i, name in enumerate(fields) if isinstance(name, str)}
        if not {"t", "step", "world_size"} <= col.keys():
            raise ValueError("history record: missing t, step or world_size")
        return cls(float(interval), tuple(_sample(row, col) for row in rows))


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _sample(row: Any, col: dict[str, int]) -> Sample:
    if not isinstance(row, list):
        raise ValueError("history record: a row is not a list")

    def get(name: str, *, optional: bool = True) -> Any:
        i = col.get(name)
        v = row[i] if i is not None and i < len(row) else None
        if v is None and optional:
            return None
        if not _is_num(v):
            raise ValueError(f"history record: {name}={v!r} is not a number")
        return v

    ckpt, rnd, loss, rate = get("checkpoint_step"), get("round"), get("loss"), get("samples_per_s")
    return Sample(t=float(get("t", optional=False)), step=int(get("step", optional=False)),
                  world_size=int(get("world_size", optional=False)),
                  samples_per_s=0.0 if rate is None else float(rate),
                  round=-1 if rnd is None else int(rnd),
                  loss=None if loss is None else float(loss),
                  checkpoint_step=None if ckpt is None else int(ckpt))


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
