"""A worker's torn error file never kills the agent (``drop_torn_error_files``)."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elasticd.agent.worker_group import drop_torn_error_files


def test_torch_parses_a_worker_error_file_uncaught():
    """The torch behaviour the agent guards against (if torch stops raising, the guard is
    idle, not wrong)."""
    import tempfile

    # Empty: truncated, not written yet.
    with tempfile.NamedTemporaryFile("w", suffix=".json") as fh, pytest.raises(ValueError):
        ProcessFailure(local_rank=0, pid=1, exitcode=78, error_file=fh.name)


def test_only_files_that_are_not_json_are_dropped_and_the_failure_then_reads_its_exit_status(tmp_path):
    torn, cut, good, missing, garbled = (tmp_path / n for n in ("torn.json", "cut.json", "good.json",
                                                                 "none.json", "garbled.json"))
    torn.write_text("")
    cut.write_text('{"message": {"message": "ConfigEr')
    good.write_text(json.dumps({"message": "ConfigError: global batch 1 < world size 2"}))
    garbled.write_bytes(b'{"message": "\xff\xfe')  # not UTF-8: torch's parse raises too
    files = {0: str(torn), 1: str(cut), 2: str(good), 3: str(missing), 4: str(garbled)}
    assert drop_torn_error_files(files) == [0, 1, 4]
    assert not torn.exists() and not cut.exists() and not garbled.exists() and good.exists()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=78, error_file=str(torn))
    assert failure.exitcode == 78 and failure.message  # torch's "no reply file" message
    assert "ConfigError" in ProcessFailure(local_rank=2, pid=2, exitcode=78, error_file=str(good)).message
