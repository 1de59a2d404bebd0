"""JSON mode: how one worker line becomes one JSON object in the agent's output."""

from __future__ import annotations

import json

from elasticd.agent.worker_logs import MAX_LINE_CHARS, TailedFile, wrap_line

F = TailedFile("/x/stdout.log", rank=3, local_rank=1, stream="stdout")


def test_plain_line_is_wrapped_with_rank_stream_job_node_and_time():
    """A printed line keeps its text under "line", with who wrote it and when."""
    obj = wrap_line("loss 0.25", F, job="j", node="n", now=0.0)
    assert obj == {"event": "worker_output", "rank": 3, "local_rank": 1, "stream": "stdout",
                   "line": "loss 0.25", "job": "j", "node": "n", "level": "info",
                   "timestamp": "1970-01-01T00:00:00Z"}
    json.dumps(obj)


def test_a_worker_json_event_is_kept_as_is_with_rank_and_stream_added():
    """The worker API's own JSON events stay queryable by event name."""
    line = json.dumps({"event": "checkpoint_saved", "step": 7, "level": "info", "job": "j"})
    obj = wrap_line(line, F, job="j", node="n", now=0.0)
    assert obj["event"] == "checkpoint_saved" and obj["step"] == 7 and obj["source"] == "worker"
    assert (obj["rank"], obj["local_rank"], obj["stream"], obj["node"]) == (3, 1, "stdout", "n")


def test_json_that_is_not_an_event_and_broken_json_are_plain_lines():
    """Only an object with an "event" is taken as an event; anything else is text."""
    for line in ('{"loss": 1}', "{not json", "[1, 2]"):
        assert wrap_line(line, F, job="j", node="n", now=0.0)["line"] == line


def test_secrets_are_masked_and_huge_lines_cut():
    """Worker output goes through the one masking rule, and is bounded in size."""
    obj = wrap_line("url s3://user:hunter2@bucket/x", F, job="j", node="n", now=0.0)
    assert "hunter2" not in obj["line"]
    big = wrap_line("x" * (MAX_LINE_CHARS + 10), F, job="j", node="n", now=0.0)
    assert big["truncated"] is True and len(big["line"]) == MAX_LINE_CHARS


def test_worker_console_events_carry_the_agents_utc_iso_time(capsys):
    """Under a console agent a worker's events are stamped like the agent's: UTC, ISO 8601."""
    import re

    import structlog

    from elasticd.logs import configure_worker_logging

    configure_worker_logging(None)
    structlog.get_logger("w").info("checkpoint_saved", step=3)
    line = capsys.readouterr().err.strip()
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[info\s*\] checkpoint_saved", line), line
