"""`[logging] format = "json"`: every line the agent writes (its events, its workers'
output, the worker API's checkpoint events) is one JSON object; console mode unchanged."""

from __future__ import annotations

import json

import pytest
from harness import ROOT

SCRIPT = str(ROOT / "tests" / "workers" / "chatty.py")
pytestmark = pytest.mark.timeout(180)


def _start(nodes, tmp_path, job: str, fmt: str, nproc: int):
    return nodes.start(job, SCRIPT, name=f"{job}-node", nnodes="1", nproc=nproc,
                       extra=["--log-format", fmt, "--checkpoint-url",
                              (tmp_path / f"ckpt-{job}").as_uri()])


def test_json_mode_every_line_is_one_json_object(nodes, tmp_path):
    """In JSON mode each line of the agent's combined stdout+stderr parses as a JSON
    object: worker prints are wrapped with rank, local rank and stream, and the workers'
    own checkpoint_saved/checkpoint_loaded events are JSON too. In console mode the
    workers' lines keep torch's `[default0]:` prefix."""
    js = _start(nodes, tmp_path, "jlog", "json", 2)
    console = _start(nodes, tmp_path, "clog", "console", 1)
    assert js.wait(150) == 0, js.log()[-3000:]
    assert console.wait(150) == 0, console.log()[-3000:]

    lines = [ln for ln in js.log().splitlines() if ln.strip()]
    events = []
    for ln in lines:
        try:
            obj = json.loads(ln)
        except ValueError:
            raise AssertionError(f"not JSON: {ln!r}") from None
        assert isinstance(obj, dict), ln
        events.append(obj)
    out = [e for e in events if e.get("event") == "worker_output"]
    for rank in (0, 1):
        said = {(e["stream"], e["line"]) for e in out if e["rank"] == rank and e["local_rank"] == rank}
        assert ("stdout", f"hello from rank {rank}") in said, said
        assert ("stderr", f"rank {rank} on stderr") in said, said
        assert ("stdout", f"rank {rank} last words, no newline") in said, said
    assert all(e["job"] == "jlog" and e["node"] == "jlog-node" and "timestamp" in e for e in out)
    for name in ("checkpoint_saved", "checkpoint_loaded"):
        got = [e for e in events if e.get("event") == name]
        assert got and all(e["source"] == "worker" and e["stream"] == "stderr" for e in got), name
    assert any(e.get("event") == "agent_exited" for e in events)

    text = console.log()
    assert "[default0]:hello from rank 0" in text and "[default0]:rank 0 on stderr" in text
    assert "worker_output" not in text
