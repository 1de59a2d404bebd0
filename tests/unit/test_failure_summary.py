"""The agent's last words when it gives up: plain lines, the exception line first."""

from __future__ import annotations

from types import SimpleNamespace

from elasticd.agent.summary import failure_line, failure_summary

STACK = ('Traceback (most recent call last):\n  File "/w/train.py", line 3, in <module>\n'
         "    import nosuchmodule\nModuleNotFoundError: No module named 'nosuchmodule'\n")
RECORDED = {"message": "ModuleNotFoundError: No module named 'nosuchmodule'",
            "extraInfo": {"py_callstack": STACK, "timestamp": "1"}}


def _failure(message: object, exitcode: int = 1) -> SimpleNamespace:
    return SimpleNamespace(message=message, exitcode=exitcode, local_rank=0, pid=42,
                           timestamp=1, error_file="/nonexistent/error.json")


def test_the_exception_line_comes_from_the_recorded_error_not_its_json():
    """torch's error-file data (a dict) gives the exception line; no data gives the exit status."""
    assert failure_line(_failure(RECORDED)) == "ModuleNotFoundError: No module named 'nosuchmodule'"
    assert failure_line(_failure("RuntimeError: boom\nmore")) == "RuntimeError: boom"
    assert failure_line(_failure("")) == "exit code 1"
    assert failure_line(_failure("", exitcode=-9)) == "killed by SIGKILL"


def test_the_summary_prints_the_error_and_traceback_plain():
    """No JSON blob, no escaped newlines: the error line, then the traceback's last lines."""
    outcome = SimpleNamespace(reason="all 2 attempts failed the same way", failures={0: _failure(RECORDED)})
    text = failure_summary(outcome)
    assert "error: ModuleNotFoundError: No module named 'nosuchmodule'" in text.splitlines()
    assert "  import nosuchmodule" in text.splitlines()[-2]
    assert "\\n" not in text and "{" not in text
