"""Spot availability traces: one JSON file each, validated before a replay uses them.

The format (shared/spot-traces/README.md): ``{"metadata": {"gap_seconds": 300},
"data": [n0, n1, ...]}``, one count of available instances per tick.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Trace:
    """One trace: its name (the file's stem and folder), tick length and counts."""

    name: str
    gap_s: float
    counts: list[int]

    @property
    def peak(self) -> int:
        return max(self.counts)

    @property
    def hours(self) -> float:
        return (len(self.counts) - 1) * self.gap_s / 3600


class TraceError(ValueError):
    """A trace file that is not a list of non-negative counts with a positive tick."""


def parse_trace(name: str, text: str) -> Trace:
    """Parse and validate one trace file's text.

    Raises:
        TraceError: not JSON, no positive ``gap_seconds``, or counts that are not
            non-negative integers (at least two of them).
    """
    try:
        doc = json.loads(text)
        gap = float(doc["metadata"]["gap_seconds"])
        counts = doc["data"]
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"{name}: not a spot trace ({exc})") from exc
    if not gap > 0:
        raise TraceError(f"{name}: gap_seconds must be positive, got {gap}")
    if not isinstance(counts, list) or len(counts) < 2 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise TraceError(f"{name}: data must be a list of at least two non-negative integers")
    return Trace(name, gap, counts)


def load_traces(folder: Path) -> list[Trace]:
    """Every ``*.json`` trace under ``folder`` (recursively), named ``<parent>/<stem>``."""
    files = sorted(folder.rglob("*.json"))
    if not files:
        raise TraceError(f"no trace files under {folder}")
    return [parse_trace(f"{f.parent.name}/{f.stem}", f.read_text()) for f in files]
