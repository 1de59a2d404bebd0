"""The harness's ``read_jsonl`` keeps what it parsed of a growing ledger: it must still see
exactly what a fresh parse of the file would (appends, a torn or unfinished last line, a
file rewritten in place or replaced, a file removed)."""

from __future__ import annotations

import json
import os

from harness import read_jsonl


def _fresh(path) -> list[dict]:
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_read_jsonl_follows_appends_torn_lines_rewrites_and_replacements(tmp_path):
    path = tmp_path / "trace.jsonl"
    assert read_jsonl(path) == []
    with open(path, "ab") as fh:
        fh.write(b'{"step": 0}\n{"step": 1}\n')
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}]
    with open(path, "ab") as fh:  # a whole row whose newline is not written yet, then a torn one
        fh.write(b'{"step": 2}')
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}, {"step": 2}]
    with open(path, "ab") as fh:
        fh.write(b'\n{"ste')
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}, {"step": 2}]
    with open(path, "ab") as fh:  # the torn line ends as garbage, and the next rows follow
        fh.write(b'\n{"step": 3}\n')
    assert read_jsonl(path) == _fresh(path) == [{"step": i} for i in range(4)]
    path.write_text('{"step": 9}\n{"step": 10}\n{"step": 11}\n{"step": 12}\n{"step": 13}\n')
    assert read_jsonl(path) == _fresh(path)  # rewritten in place, longer than before
    path.write_text('{"step": 7}\n')
    assert read_jsonl(path) == [{"step": 7}]  # rewritten shorter
    tmp = tmp_path / "new.jsonl"
    tmp.write_text('{"step": 8}\n')
    os.replace(tmp, path)
    assert read_jsonl(path) == [{"step": 8}]
    rows = read_jsonl(path)
    rows.append({"mine": 1})  # the caller's list is its own
    assert read_jsonl(path) == [{"step": 8}]
    path.unlink()
    assert read_jsonl(path) == []
