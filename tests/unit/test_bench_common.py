"""The recovery benchmark's step bookkeeping (benchmarks/common.py)."""

from __future__ import annotations

from benchmarks.common import first_step_at, newer_rounds


def _step(step: int, at: float, round_: int | None, world: int = 3) -> dict:
    return {"step": step, "world": world, "time": at, "rank": 0, "round": round_}


def test_a_spare_counts_only_the_rounds_after_the_fault() -> None:
    """The old group's last step can complete after the kill (its line arrives later): at
    the same world size it must not pass for the first step with the spare in it."""
    records = [_step(126, 9.9, 0), _step(127, 10.08, 0), _step(128, 10.4, 1), _step(129, 10.5, 1),
               {"event": "start", "rank": 0, "world": 3, "ready": 10.3}]
    assert first_step_at(records, 3, 10.0, 1) == (127, 10.08)
    kept = newer_rounds(records, 10.0)
    assert first_step_at(kept, 3, 10.0, 1) == (128, 10.4)
    assert any(r.get("event") == "start" for r in kept)


def test_records_without_rounds_are_kept() -> None:
    records = [_step(1, 1.0, None), _step(2, 2.0, None)]
    assert newer_rounds(records, 1.5) == records
