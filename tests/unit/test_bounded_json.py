"""The one bounded JSON reader (elasticd.boundedjson) and every source that decodes with it:
a value nested 100,000 deep is refused as a ValueError of the source's own kind, never a
RecursionError; a FIFO is refused without blocking."""

from __future__ import annotations

import json
import os

import pytest

from elasticd import boundedjson
from elasticd.boundedjson import BoundedJSONError, NotRegularFileError

DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"a":' * 20_000 + b"1" + b"}" * 20_000


def test_depth_is_measured_before_decoding_and_ignores_brackets_in_strings():
    """depth_of counts container nesting only (brackets inside strings are text)."""
    assert boundedjson.depth_of(b"1") == 0
    assert boundedjson.depth_of(b"{}") == 1
    assert boundedjson.depth_of(b'[[1],[2,[3]]]') == 3
    assert boundedjson.depth_of(b'{"a": "[[[[{{{{", "b": "\\"[["}') == 1
    assert boundedjson.depth_of(DEEP) == 100_000


def test_loads_refuses_deep_large_or_non_json_as_value_errors():
    """Too deep, too large, not UTF-8, not JSON, or not an object: BoundedJSONError (a ValueError)."""
    with pytest.raises(BoundedJSONError, match="100000 deep"):
        boundedjson.loads(DEEP, what="x", max_bytes=1 << 20)
    with pytest.raises(BoundedJSONError, match="deeper than 32"):
        boundedjson.loads(DEEP_OBJECT, what="x", max_bytes=1 << 20)
    with pytest.raises(BoundedJSONError, match="limit"):
        boundedjson.loads(b"[" + b"1," * 600 + b"1]", what="x", max_bytes=1000)
    for bad in (b"\xff\xfe", b"{", b"nan-ish"):
        with pytest.raises(BoundedJSONError, match="not JSON"):
            boundedjson.loads(bad, what="x", max_bytes=100)
    with pytest.raises(BoundedJSONError, match="not an object"):
        boundedjson.loads_object(b"[1]", what="x", max_bytes=100)
    nested = {"a": [{"b": [1, 2, {"c": None}]}]}
    assert boundedjson.loads_object(json.dumps(nested), what="x", max_bytes=100) == nested
    assert boundedjson.loads(b"[" * 32 + b"]" * 32, what="x", max_bytes=100) is not None


def test_check_depth_walks_a_decoded_value_without_recursion():
    """check_depth refuses a parsed value nested deeper than its bound (iteratively)."""
    deep: list[object] = []
    cur = deep
    for _ in range(50_000):
        nxt: list[object] = []
        cur.append(nxt)
        cur = nxt
    with pytest.raises(BoundedJSONError):
        boundedjson.check_depth(deep, what="x", max_depth=16)
    boundedjson.check_depth({"job": {"name": "a", "tags": [[1]]}}, what="x", max_depth=16)


def test_read_file_refuses_a_fifo_without_blocking_and_bounds_size(tmp_path):
    """A FIFO is NotRegularFileError at once (no writer needed); an oversized file is refused;
    a directory is IsADirectoryError."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFileError):
        boundedjson.read_file(fifo, max_bytes=100)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(BoundedJSONError, match="limit"):
        boundedjson.read_file(big, max_bytes=100)
    with pytest.raises(IsADirectoryError):
        boundedjson.read_file(tmp_path, max_bytes=100)
    ok = tmp_path / "ok"
    ok.write_bytes(b'{"a": 1}')
    assert boundedjson.load_file(ok, what="ok", max_bytes=100) == {"a": 1}


# -- one test per source ------------------------------------------------------------------

def test_etcd_records_refuse_deep_values_as_record_errors():
    """etcd records (nodes, rounds, pointer, progress): a deep value is a RecordError."""
    from elasticd.records import CheckpointPointer, NodeRecord, RecordError

    for cls in (NodeRecord, CheckpointPointer):
        with pytest.raises(RecordError):
            cls.from_json(DEEP)


def test_history_record_refuses_a_deep_value_as_value_error():
    """/elasticd/<job>/history nested 100,000 deep is a ValueError (the writer replaces it)."""
    from elasticd.history import History

    with pytest.raises(ValueError, match="deep"):
        History.from_json(DEEP)
    with pytest.raises(ValueError):
        History.from_json(b'{"v": 1, "interval_s": 5, "fields": ' + DEEP + b', "rows": []}')


def test_status_trend_line_survives_a_deep_history():
    """`status --watch`'s trend line of a deep history record is empty, not a crash."""
    from elasticd.status.plot import trend_line

    assert trend_line(DEEP) == ""


def test_manifest_refuses_a_deep_value_as_corrupt():
    """A manifest.json nested deep under the 1 MiB cap is CheckpointCorruptError (skipped)."""
    from elasticd.checkpoint.api import CheckpointCorruptError
    from elasticd.checkpoint.manifest import Manifest

    with pytest.raises(CheckpointCorruptError, match="deep"):
        Manifest.from_json(DEEP)


def test_control_socket_line_refuses_a_deep_value_as_message_error():
    """A 60 KB nested line on the control socket is a MessageError (answered, not a traceback)."""
    from elasticd.control.messages import MessageError, parse_reply, parse_request

    line = b"[" * 30_000 + b"]" * 30_000
    with pytest.raises(MessageError, match="deep"):
        parse_request(line)
    with pytest.raises(MessageError):
        parse_reply(line)
    with pytest.raises(MessageError) as caught:
        parse_request(line)
    assert caught.value.request_id is None


def test_reform_order_refuses_deep_files(tmp_path):
    """The re-formation order file: deep content is skipped."""
    from elasticd.control.reform import ReformOrder, read_order

    with pytest.raises(ValueError):
        ReformOrder.from_json(DEEP)
    (tmp_path / "reform.json").write_bytes(DEEP)
    assert read_order(tmp_path) is None


def test_stopped_markers_skip_deep_files(tmp_path):
    """The control dir's stopped-<rank> reports: a deep or FIFO file is skipped."""
    from elasticd.control.api import STOPPED_PREFIX
    from elasticd.control.messages import StoppedReport, serialise
    from elasticd.control.server import ControlChannel

    d = ControlChannel(directory=tmp_path)
    (tmp_path / f"{STOPPED_PREFIX}0").write_bytes(DEEP)
    os.mkfifo(tmp_path / f"{STOPPED_PREFIX}1")
    (tmp_path / f"{STOPPED_PREFIX}2").write_bytes(serialise(StoppedReport(rank=2, step=7, round=1)))
    assert d.stopped_markers() == {2: StoppedReport(rank=2, step=7, round=1)}


def test_worker_log_line_that_is_deep_json_is_forwarded_as_text():
    """A worker's stdout line of deep JSON is wrapped as text, not decoded (no crash)."""
    from elasticd.agent.worker_logs import TailedFile, wrap_line

    line = '{"event": "x", "a": ' + "[" * 30_000 + "]" * 30_000 + "}"
    out = wrap_line(line, TailedFile("p", 0, 0, "stdout"), job="j", node="n", now=0.0)
    assert out["event"] == "worker_output"


def test_commit_intents_skip_deep_or_fifo_files(tmp_path):
    """Commit-intent files on disk: a deep one or a FIFO is skipped, not a crash or a hang."""
    from elasticd.agent.commits import INTENT_PREFIX, read_intents

    (tmp_path / f"{INTENT_PREFIX}a.json").write_bytes(DEEP)
    os.mkfifo(tmp_path / f"{INTENT_PREFIX}b.json")
    assert read_intents(tmp_path, "j") == []


def test_cloud_metadata_bodies_refuse_deep_values():
    """A deep body from the cloud metadata service is a MetadataError."""
    from elasticd.agent.cloud_metadata import (
        MetadataError,
        parse_aws_instance_action,
        parse_azure_scheduled_events,
    )

    with pytest.raises(MetadataError):
        parse_aws_instance_action(200, DEEP)
    with pytest.raises(MetadataError):
        parse_azure_scheduled_events(200, DEEP, None)


def test_config_file_nested_deep_or_a_fifo_is_a_config_error(tmp_path):
    """A 20,000-deep TOML array, or a FIFO as --config, is a ConfigError naming the file."""
    from elasticd.config import load_config
    from elasticd.errors import ConfigError

    deep = tmp_path / "deep.toml"
    deep.write_text("[job]\nname = " + "[" * 20_000 + "]" * 20_000 + "\n")
    with pytest.raises(ConfigError, match="deeper than"):
        load_config(str(deep), {}, {})
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(str(fifo), {}, {})


def test_etcd_cluster_layout_file_deep_is_a_config_error(tmp_path):
    """`elasticd etcd --data-dir`'s cluster.json nested deep is a ConfigError."""
    from elasticd.cli.etcd import LAYOUT_FILE, _layout
    from elasticd.errors import ConfigError

    (tmp_path / LAYOUT_FILE).write_bytes(DEEP)
    with pytest.raises(ConfigError, match="unreadable"):
        _layout(str(tmp_path), 3)
