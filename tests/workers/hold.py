"""The test's pace for worker scripts: wait before a step while a hold file says so.

While ``path`` exists and names a step ``S``, a worker waits before any step ``>= S``; the
test moves the hold on (or removes the file) after the fault it is about. Every rank reads
the same file before the same step, so no rank enters a collective its peers hold back.
The wait polls and gives up after ``max_s`` (a test that never releases fails on its own
deadline, not here). Imported by scripts in this folder (their folder is on sys.path).
"""

from __future__ import annotations

import time


def wait_while_held(path: str | None, step: int, max_s: float = 180.0) -> None:
    """Return once ``path`` is absent or names a step after ``step`` (or after ``max_s``)."""
    deadline = time.monotonic() + max_s
    while path and time.monotonic() < deadline:
        try:
            with open(path) as f:
                held = int(f.read().strip() or -1)
        except FileNotFoundError:
            return
        except ValueError:  # caught mid-write: read again
            held = step
        if step < held:
            return
        time.sleep(0.02)
