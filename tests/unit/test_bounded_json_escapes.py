"""A 64 KB run of escaped quotes (``'"' + '\\"' * 32000``) is refused or parsed in
milliseconds by every source that decodes through elasticd.boundedjson.

Why: the pre-scan that strips strings before measuring depth backtracked from every quote
of an unterminated run to the end of the text: quadratic, holding the GIL (64 KB: 23 s of
CPU; observed live: a rank-0 agent frozen by a ``history`` value, the root agent frozen 111 s
by one control-socket line). Each source is timed with ``time.process_time`` against a
bound the quadratic scan misses by orders of magnitude; the short per-test timeout makes
the old code fail fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from elasticd import boundedjson
from elasticd.agent.cloud_metadata import (
    MetadataError,
    parse_aws_instance_action,
    parse_azure_scheduled_events,
)
from elasticd.agent.commits import INTENT_PREFIX, read_intents
from elasticd.agent.worker_logs import TailedFile, wrap_line
from elasticd.checkpoint.api import CheckpointCorruptError
from elasticd.checkpoint.manifest import Manifest
from elasticd.checkpoint.shards import parse_index
from elasticd.control.api import STOPPED_PREFIX
from elasticd.control.messages import MessageError, parse_reply, parse_request
from elasticd.control.reform import read_order
from elasticd.control.server import ControlChannel
from elasticd.etcd.kv import KV
from elasticd.history import History
from elasticd.keys import JobKeys
from elasticd.records import CheckpointPointer, NodeRecord, RecordError
from elasticd.status.plot import trend_line
from elasticd.status.snapshot import parse_job_kvs

BOUND_S = 0.5  # the linear scan takes ~1 ms here; the quadratic one took > 20 s
ESCAPES = b'"' + b'\\"' * 32_000  # 64,001 bytes, an unterminated string
# The same run as a field value inside a record-shaped object.
IN_OBJECT = b'{"v": 1, "node_id": ' + ESCAPES
PAYLOADS = [pytest.param(ESCAPES, id="bare"), pytest.param(IN_OBJECT, id="in-object")]


@contextmanager
def fast(what: str) -> Iterator[None]:
    start = time.process_time()
    yield
    spent = time.process_time() - start
    assert spent < BOUND_S, f"{what} took {spent:.2f} s of CPU on a 64 KB escaped-quote run"


def refused_fast(what: str, parse: Callable[[], object], error: type[BaseException]) -> None:
    with fast(what), pytest.raises(error):
        parse()


def test_the_pre_scan_is_linear_on_long_and_terminated_strings():
    """depth_of strips strings in one pass: 1 MiB of escaped quotes, and strings still hide brackets."""
    with fast("depth_of, 1 MiB"):
        assert boundedjson.depth_of(b'"' + b'\\"' * (1 << 19)) == 0
    assert boundedjson.depth_of(b'["\\"[[", [' + ESCAPES) == 2  # brackets before the run count
    assert boundedjson.depth_of(b'["a\\\\", ["b"]]') == 2  # an escaped backslash ends no string
    assert boundedjson.depth_of(b'["trailing backslash \\') == 1
    assert boundedjson.loads(b'["\\"" , "x\\\\"]', what="x", max_bytes=100) == ['"', "x\\"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_etcd_records_refuse_escape_runs_fast(payload):
    """etcd records (node record, checkpoint pointer): a RecordError in milliseconds."""

    for cls in (NodeRecord, CheckpointPointer):
        refused_fast(cls.__name__, lambda c=cls: c.from_json(payload), RecordError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_history_record_refuses_escape_runs_fast(payload):
    """/elasticd/<job>/history and status's trend line of it: refused in milliseconds."""

    refused_fast("history record", lambda: History.from_json(payload), ValueError)
    with fast("trend line"):
        assert trend_line(payload) == ""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_status_snapshot_of_escape_run_records_is_fast(payload):
    """`elasticd status` decoding a node record and progress of 64 KB escapes: skipped in milliseconds."""

    keys = JobKeys("j")
    kvs = [KV(keys.node("n1"), payload, 5, 5, 0), KV(keys.progress, payload, 6, 6, 0)]
    with fast("status snapshot"):
        snap = parse_job_kvs("j", kvs, 7)
    assert snap is not None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_control_socket_line_refuses_escape_runs_fast(payload):
    """A control-socket line of 64 KB escapes: one MessageError in milliseconds, parsed once."""

    refused_fast("request line", lambda: parse_request(payload + b"\n"), MessageError)
    refused_fast("reply line", lambda: parse_reply(payload + b"\n"), MessageError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_manifest_refuses_escape_runs_fast(payload):
    """manifest.json of 64 KB escapes: CheckpointCorruptError (skipped) in milliseconds."""

    refused_fast("manifest", lambda: Manifest.from_json(payload), CheckpointCorruptError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_shard_index_refuses_escape_runs_fast(payload):
    """A shard index of 64 KB escapes: CheckpointCorruptError in milliseconds."""

    refused_fast("shard index", lambda: parse_index(payload, "index-0.json"),
                 CheckpointCorruptError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_control_dir_files_refuse_escape_runs_fast(payload, tmp_path):
    """The re-formation order, stopped markers and commit intents: skipped in milliseconds."""

    (tmp_path / "reform.json").write_bytes(payload)
    (tmp_path / f"{STOPPED_PREFIX}0").write_bytes(payload)
    (tmp_path / f"{INTENT_PREFIX}a.json").write_bytes(payload)
    with fast("control dir files"):
        assert read_order(tmp_path) is None
        assert ControlChannel(directory=tmp_path).stopped_markers() == {}
        assert read_intents(tmp_path, "j") == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_worker_log_and_cloud_metadata_refuse_escape_runs_fast(payload):
    """A worker's log line and a cloud metadata body of 64 KB escapes: handled in milliseconds."""

    with fast("worker log line"):
        out = wrap_line("{" + payload.decode()[1:], TailedFile("p", 0, 0, "stdout"), job="j",
                        node="n", now=0.0)
    assert out["event"] == "worker_output"
    refused_fast("AWS body", lambda: parse_aws_instance_action(200, payload), MetadataError)
    refused_fast("Azure body", lambda: parse_azure_scheduled_events(200, payload, None),
                 MetadataError)


def test_a_refused_request_carries_its_id_from_the_one_parse():
    """A request line with a valid id but a bad op: the MessageError carries the id (no second parse)."""

    with pytest.raises(MessageError, match="unknown op") as caught:
        parse_request(b'{"op": "nope", "id": 7}\n')
    assert caught.value.request_id == 7
    with pytest.raises(MessageError) as caught:
        parse_request(b'{"op": "commit", "id": -1}\n')
    assert caught.value.request_id is None
