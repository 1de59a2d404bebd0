"""JSON mode renders every source of agent log lines as one JSON object per line."""

from __future__ import annotations

import io
import json
import logging
import warnings

import structlog

from elasticd import logs


def test_structlog_torch_stdlib_and_warnings_are_json_lines(monkeypatch):
    """An event, a torch elastic error (torch's own glog-style handler), another stdlib
    logger and warnings.warn each come out as one parseable JSON line."""
    # A torch-namespace logger that, like torch's registered ones, does not propagate and
    # has a stream handler of its own.
    torch_root = logging.getLogger("torch.elasticd_probe")
    torch_logger = torch_root
    out = io.StringIO()
    probe = logging.StreamHandler(out)  # stands in for torch's own stream handler
    torch_root.addHandler(probe)
    saved = (structlog.get_config(), logging.root.handlers[:], logging.root.level,
             torch_root.propagate, logs._configured, logs._format)
    torch_root.propagate = False
    try:
        logs.configure_logging("json", stream=out)
        assert logs.current_format() == "json"
        structlog.get_logger("t").info("thing_happened", n=1)
        torch_logger.error("failed (exitcode: %s) local_rank: %s", 1, 0)
        logging.getLogger("someone.else").warning("plain %s", "text")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("careful", UserWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
        torch_root.removeHandler(probe)
        torch_root.propagate = saved[3]
        for h in logging.root.handlers[:]:
            if h not in saved[1]:
                logging.root.removeHandler(h)
        logging.root.setLevel(saved[2])
        structlog.configure(**saved[0])
        logs._configured, logs._format = saved[4], saved[5]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    events = [e["event"] for e in lines]
    assert events[0] == "thing_happened"
    assert "failed (exitcode: 1) local_rank: 0" in events
    assert "plain text" in events
    assert any("careful" in e for e in events)
