"""The test-controlled end of a job: tests/harness.end_job writes the step count, and
examples/train.py's ``--end-file`` reads it at every step (the same count on every rank).

A job ends on the test's word after the phase it is about, not on a step count chosen to
outlast a race; these pin the arithmetic and the reading, without a job.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from harness import ROOT, end_job


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("example_train", ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace(path, newest: int) -> None:
    path.write_text("".join(json.dumps({"step": s, "rank": 0, "round": 0}) + "\n"
                            for s in range(newest + 1)))


def test_end_job_ends_margin_steps_past_the_newest_rounded_to_whole_epochs(tmp_path):
    """Newest step 23, margin 10, 20 steps an epoch: 40 steps in all (two whole epochs);
    with no rounding 34; given the newest step as a number, the same."""
    trace, end = tmp_path / "trace.jsonl", tmp_path / "end"
    _trace(trace, 23)
    assert end_job(end, trace, epoch_steps=20) == 40 and end.read_text() == "40"
    assert end_job(end, trace) == 34 and end.read_text() == "34"
    assert end_job(end, 23, margin=2) == 26
    assert not list(tmp_path.glob("*.staged")), "the staged file was left behind"


def test_the_example_trains_the_written_count_or_its_steps_whichever_is_fewer(train, tmp_path):
    """No file, an empty or half-written one: --steps; a count below --steps: that count;
    one above: --steps."""
    end = tmp_path / "end"
    args = train.parse_args(["--steps", "100", "--end-file", str(end)])
    assert train.end_step(args) == 100
    for text, want in (("", 100), ("4", 4), ("4x", 100), ("250", 100)):
        end.write_text(text)
        assert train.end_step(args) == want, text
    assert train.end_step(train.parse_args(["--steps", "7"])) == 7  # no --end-file
