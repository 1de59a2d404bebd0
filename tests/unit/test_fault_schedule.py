"""tests/harness.FaultSchedule: phases fire in order on their trace triggers, each records
what the trace showed, and a trigger that never fires fails naming its phase.

The "job" here is the test appending trace rows from the phases' own actions, so every
trigger is already true when it is polled: nothing sleeps.
"""

from __future__ import annotations

import json

import pytest
from harness import FaultSchedule, at_step, in_newer_round


def _write(trace, *rows):
    with open(trace, "a") as fh:
        for step, rank, round_, world in rows:
            fh.write(json.dumps({"step": step, "rank": rank, "round": round_, "world": world}) + "\n")


def test_phases_fire_in_order_and_record_the_trace_they_saw(tmp_path):
    """kill at step 3 of world 2, join once world 1 trains in a newer round, mark world 2:
    each action runs once its trigger holds, and each record has the rows, round and step
    seen then; later triggers only look past the previous phase."""
    trace = tmp_path / "trace.jsonl"
    _write(trace, *[(s, r, 0, 2) for s in range(4) for r in (0, 1)])
    done: list[str] = []

    def kill():
        done.append("kill")
        _write(trace, (4, 0, 1, 1))

    def join():
        done.append("join")
        _write(trace, (5, 0, 2, 2), (5, 1, 2, 2))
        return "node c"

    fired = (FaultSchedule(trace, timeout_s=0)
             .when(at_step(3, world=2, ranks=2), "step 3 at world 2").do(kill)
             .when(in_newer_round(world=1), "world 1 after the kill").do(join)
             .when(in_newer_round(world=2), "world 2 after the join").mark())
    records = fired.run()
    assert done == ["kill", "join"]
    assert [(f.rows, f.round, f.step) for f in records.values()] == [(8, 0, 3), (9, 1, 4), (11, 2, 5)]
    assert fired.results["world 1 after the kill"] == "node c"


def test_a_trigger_that_never_fires_fails_naming_its_phase(tmp_path):
    """No row of a newer round: the schedule fails with the phase's name, after running the
    phases before it."""
    trace = tmp_path / "trace.jsonl"
    _write(trace, (0, 0, 0, 2))
    ran: list[int] = []
    schedule = (FaultSchedule(trace, timeout_s=0)
                .when(at_step(0), "first step").do(lambda: ran.append(1))
                .when(in_newer_round(), "a re-formation").mark())
    with pytest.raises(AssertionError, match="phase 'a re-formation'"):
        schedule.run()
    assert ran == [1]


def test_a_schedule_is_built_whole():
    """An action needs a trigger before it, a trigger an action after it, names are unique."""
    with pytest.raises(ValueError, match="when"):
        FaultSchedule(None).mark()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no action"):
        FaultSchedule(None).when(at_step(1), "a").when(at_step(2), "b")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two phases"):
        FaultSchedule(None).when(at_step(1), "a").mark().when(at_step(2), "a")  # type: ignore[arg-type]
