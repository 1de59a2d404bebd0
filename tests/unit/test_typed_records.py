"""Every typed record read through the one validating codec: today's wire forms still read,
and malformed input (wrong type, unknown enum value, bool for an int, oversized or deep
JSON) is refused naming the record and the field."""

from __future__ import annotations

import pytest

from elasticd import codec
from elasticd.control.api import CommitOutcome
from elasticd.control.messages import (
    AwaitOrder,
    CheckpointIo,
    CheckpointIoKind,
    CommitReply,
    CommitRequest,
    ErrorReply,
    LatestReply,
    LatestRequest,
    LeaveReason,
    LiveRegistration,
    MessageError,
    OrderNotice,
    ParkedReport,
    Ping,
    Pong,
    ReformedReport,
    StepReport,
    StoppedReport,
    parse_reply,
    parse_request,
    parse_stopped,
    serialise,
)
from elasticd.control.reform import ReformOrder
from elasticd.records import CheckpointPointer

# Lines written by main before the codec (d17aa79: messages.serialise, ReformOrder.to_json).
OLD_REQUESTS = {
    b'{"op":"progress","local_rank":1,"rank":5,"step":10,"epoch":2,"samples":640,"loss":0.25,'
    b'"save_every":50,"save_interval_s":12.5,"cadence":"auto: save 2.0 s"}\n':
        StepReport(local_rank=1, rank=5, step=10, epoch=2, samples=640, loss=0.25, save_every=50,
                   save_interval_s=12.5, cadence="auto: save 2.0 s"),
    b'{"op":"checkpoint_io","kind":"load","step":40,"seconds":0.25,"nbytes":38597}\n':
        CheckpointIo(kind=CheckpointIoKind.LOAD, step=40, seconds=0.25, nbytes=38597),
    b'{"op":"commit","step":100,"manifest_url":"file:///ck/step-000000000100/1765000000000-0a1b2c3d'
    b'/manifest.json","world_size":4,"round":3,"id":9}\n':
        CommitRequest(step=100, manifest_url="file:///ck/step-000000000100/1765000000000-0a1b2c3d"
                      "/manifest.json", world_size=4, round=3, id=9),
    b'{"op":"latest","id":2}\n': LatestRequest(id=2),
    b'{"op":"ping","id":3}\n': Ping(id=3),
    b'{"op":"live","local_rank":0,"pid":4242,"id":4}\n': LiveRegistration(local_rank=0, pid=4242, id=4),
    b'{"op":"parked","local_rank":1,"round":3,"step":-1,"reason":"collective_failed","id":5}\n':
        ParkedReport(local_rank=1, round=3, step=-1, reason=LeaveReason.COLLECTIVE_FAILED, id=5),
    b'{"op":"reformed","local_rank":1,"round":4,"step":99,"id":6}\n':
        ReformedReport(local_rank=1, round=4, step=99, id=6),
    b'{"op":"await_order","after_round":3,"timeout_s":30.0,"id":7}\n':
        AwaitOrder(after_round=3, timeout_s=30.0, id=7),
}
OLD_REPLIES = {
    b'{"op":"commit_reply","outcome":"unknown","reason":"etcd timed out","id":9,"ok":false}\n':
        CommitReply(outcome=CommitOutcome.UNKNOWN, reason="etcd timed out", id=9),
    b'{"op":"pong","id":3}\n': Pong(id=3),
    b'{"op":"error","reason":"unknown op \'x\'","id":null}\n': ErrorReply(reason="unknown op 'x'", id=None),
    b'{"op":"order_notice","round":4,"id":7}\n': OrderNotice(round=4, id=7),
}
OLD_LATEST_REPLY = (b'{"op":"latest_reply","ok":true,"pointer":{"committed_at":1765000000.5,"high_water":120,'
                    b'"manifest_url":"file:///m.json","round":3,"run_id":"0123456789abcdef","step":100,'
                    b'"world_size":4},"reason":"","id":2}\n')
OLD_STOPPED = b'{"op":"stopped","rank":3,"step":77,"round":2,"live_fallback":"no peer held step 77"}\n'
OLD_ORDER = ('{"round": 7, "world_size": 3, "master_addr": "10.0.0.1", "master_port": 29500, '
             '"ranks": {"0": 2, "1": 1}}')


@pytest.mark.timeout(10)
def test_control_messages_written_by_the_old_parser_read_and_are_written_byte_identically():
    """Every control message line main wrote before the codec parses to the same value,
    and serialising that value gives the same bytes (the wire format is unchanged)."""
    for line, want in OLD_REQUESTS.items():
        assert parse_request(line) == want
        # A field added since is written after the old ones (an old parser ignores it):
        # the progress report's step_s.
        added = b',"step_s":0.0' if isinstance(want, StepReport) else b""
        assert serialise(want) == line[:-2] + added + line[-2:] if added else serialise(want) == line
    for line, want in OLD_REPLIES.items():
        assert parse_reply(line) == want
        assert serialise(want) == line
    assert parse_stopped(OLD_STOPPED) == StoppedReport(rank=3, step=77, round=2,
                                                        live_fallback="no peer held step 77")
    assert serialise(parse_stopped(OLD_STOPPED)) == OLD_STOPPED
    pointer = CheckpointPointer(step=100, round=3, manifest_url="file:///m.json",
                                committed_at=1765000000.5, world_size=4, high_water=120,
                                run_id="0123456789abcdef")
    assert parse_reply(OLD_LATEST_REPLY) == LatestReply(ok=True, pointer=pointer, reason="", id=2)


@pytest.mark.timeout(10)
def test_a_reform_order_written_by_the_old_writer_reads_and_round_trips():
    """``reform.json`` as main wrote it (local ranks as string keys) reads to the same order,
    and the new writer's text is the old text."""
    order = ReformOrder(round=7, world_size=3, master_addr="10.0.0.1", master_port=29500,
                        ranks={0: 2, 1: 1})
    assert ReformOrder.from_json(OLD_ORDER) == order
    assert order.to_json() == OLD_ORDER


def _msg(body: bytes) -> bytes:
    return body + b"\n"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("line", "error"), [
    (b'{"op":"parked","local_rank":0,"round":1,"step":1,"reason":"bored"}',
     r"parked message\.reason: 'bored' is not one of 'collective_failed'"),
    (b'{"op":"live","local_rank":true,"pid":5}', r"live message\.local_rank: expected int, got a boolean"),
    (b'{"op":"checkpoint_io","kind":"save","step":1,"seconds":1,"nbytes":"9"}',
     r"checkpoint_io message\.nbytes: expected int, got a string"),
    (b'{"op":"await_order","after_round":1,"timeout_s":61}', r"await_order message\.timeout_s: 61.0 is outside \[0, 60.0\]"),
    (b'{"op":"ping","id":1,"pad":' + b"[" * 40 + b"]" * 40 + b"}", r"nest"),
    (b'{"op":"ping","id":1.0}', r"ping message\.id: expected int, got a number"),
])
def test_a_malformed_request_is_refused_naming_the_field(line, error):
    """A request with an unknown enum value, a bool or float for an int, a string for a
    count, an out-of-bound duration or JSON nested past the bound is a MessageError naming it."""
    with pytest.raises(MessageError, match=error):
        parse_request(_msg(line))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("line", "error"), [
    (b'{"op":"commit_reply","outcome":"maybe","reason":"","id":1}',
     r"commit_reply message\.outcome: 'maybe' is not one of 'committed'"),
    (b'{"op":"latest_reply","ok":1,"id":1}', r"latest_reply message\.ok: expected bool, got a number"),
    (b'{"op":"latest_reply","ok":true,"pointer":{"step":true,"round":0,"manifest_url":"u",'
     b'"committed_at":0},"id":1}', r"latest_reply message\.pointer\.step: expected int, got a boolean"),
    (b'{"op":"order_notice","round":-2,"id":1}', r"order_notice message\.round: -2 is outside"),
])
def test_a_malformed_reply_is_refused_naming_the_field(line, error):
    """A reply with an unknown outcome, a number for a bool, a bool inside the pointer or
    an out-of-range round is a MessageError naming the field."""
    with pytest.raises(MessageError, match=error):
        parse_reply(_msg(line))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("text", "error"), [
    ('{"round": true, "world_size": 3, "master_addr": "h", "master_port": 1, "ranks": {}}',
     r"re-formation order\.round: expected int, got a boolean"),
    ('{"round": 1, "world_size": 3, "master_addr": "h", "master_port": 70000, "ranks": {}}',
     r"re-formation order\.master_port: 70000 is outside"),
    ('{"round": 1, "world_size": 3, "master_addr": "", "master_port": 1, "ranks": {}}',
     r"re-formation order\.master_addr: 0 characters long"),
    ('{"round": 1, "world_size": 3, "master_addr": "h", "master_port": 1, "ranks": {"x": 0}}',
     r"re-formation order\.ranks: key 'x' is not an integer"),
    ('{"round": 1, "world_size": 3, "master_addr": "h", "master_port": 1, "ranks": {"0": 3}}',
     r"re-formation order: ranks \{0: 3\} are outside \[0, world_size=3\)"),
    ('{"round": 1, "world_size": 3, "master_addr": "h", "master_port": 1, "ranks": {"0": "1"}}',
     r"re-formation order\.ranks\['0'\]: expected int, got a string"),
    ('{"round": 1, "world_size": 3, "master_addr": "' + "h" * (1 << 20) + '"}', r"re-formation order"),
    ('{"round": 1, "x": ' + "[" * 40 + "]" * 40 + "}", r"nest"),
])
def test_a_malformed_reform_order_is_refused_naming_the_field(text, error):
    """An order with a bool round, a port out of range, an empty host, a non-integer local
    rank, a global rank outside the world, a string rank, or oversized or deep JSON is a
    RecordDecodeError (a ValueError: ``read_order`` reads it as absent) naming the field."""
    with pytest.raises(codec.RecordDecodeError, match=error):
        ReformOrder.from_json(text)


# Written by main before the codec (d17aa79: History.to_json, Manifest.to_json).
OLD_HISTORY = ('{"v":1,"interval_s":10.0,"fields":["t","step","world_size","samples_per_s","round",'
               '"loss","checkpoint_step"],"rows":[[1765000000.125,10,2,51.5,3,0.75,null],'
               '[1765000010.5,20,4,99.25,4,null,10]]}')
OLD_MANIFEST = (b'{\n "committed_at": 1765000001.5,\n "created_at": 1765000000.0,\n "elasticd_version": '
                b'"0.9.0",\n "files": [\n  {\n   "crc32": "deadbeef",\n   "name": "state.pt",\n   "size": '
                b'1234\n  }\n ],\n "format": "elasticd-checkpoint",\n "format_version": 1,\n "job": "demo",\n'
                b' "manifest_crc32": "ff6558f7",\n "parts": [\n  "model",\n  "optim"\n ],\n "run_id": '
                b'"0123456789abcdef",\n "sampler": {\n  "epoch": 1,\n  "samples": 6400\n },\n "save_id": '
                b'"1765000000000-0a1b2c3d",\n "step": 100,\n "torch_version": "2.13.0",\n "world_size": 4\n}')
OLD_SHARDED_MANIFEST = (
    b'{\n "committed_at": 1765000001.5,\n "created_at": 1765000000.0,\n "elasticd_version": "",\n'
    b' "files": [\n  {\n   "crc32": "00000001",\n   "name": "shards-r00000.bin",\n   "size": 64\n  },\n'
    b'  {\n   "crc32": "abcdef01",\n   "name": "shards-r00000.json",\n   "size": 300\n  },\n  {\n'
    b'   "crc32": "00000002",\n   "name": "state.pt",\n   "size": 10\n  }\n ],\n "format": '
    b'"elasticd-checkpoint",\n "format_version": 2,\n "job": "demo",\n "manifest_crc32": "79a647de",\n'
    b' "parts": [\n  "model"\n ],\n "run_id": "",\n "sampler": null,\n "save_id": '
    b'"1765000000000-0a1b2c3e",\n "shards": [\n  "shards-r00000.json"\n ],\n "step": 7,\n'
    b' "torch_version": "",\n "world_size": 2\n}')


@pytest.mark.timeout(10)
def test_a_history_record_written_by_the_old_writer_reads_and_round_trips():
    """``/elasticd/<job>/history`` as main wrote it reads to the same samples (nulls as
    absent loss and checkpoint) and is written back byte for byte."""
    from elasticd.history import History, Sample

    history = History.from_json(OLD_HISTORY)
    assert history == History(10.0, (Sample(1765000000.125, 10, 2, 51.5, 3, 0.75, None),
                                     Sample(1765000010.5, 20, 4, 99.25, 4, None, 10)))
    assert history.to_json() == OLD_HISTORY


@pytest.mark.timeout(10)
def test_manifests_written_by_the_old_writer_read_and_are_written_byte_identically():
    """A v1 and a v2 (sharded) ``manifest.json`` as main wrote them read to the same
    manifest, and writing it again gives the same bytes (the self-checksum still holds)."""
    from elasticd.checkpoint.manifest import FileEntry, Manifest

    m = Manifest.from_json(OLD_MANIFEST)
    assert m == Manifest(job="demo", step=100, save_id="1765000000000-0a1b2c3d", world_size=4,
                         created_at=1765000000.0, committed_at=1765000001.5,
                         files=(FileEntry("state.pt", 1234, 0xDEADBEEF),), parts=("model", "optim"),
                         sampler={"epoch": 1, "samples": 6400}, torch_version="2.13.0",
                         elasticd_version="0.9.0", run_id="0123456789abcdef")
    assert m.to_json() == OLD_MANIFEST
    sharded = Manifest.from_json(OLD_SHARDED_MANIFEST)
    assert sharded.shards == ("shards-r00000.json",) and sharded.files[1].crc32 == 0xABCDEF01
    assert sharded.to_json() == OLD_SHARDED_MANIFEST


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("text", "error"), [
    ('{"v":2,"interval_s":5,"fields":["t","step","world_size"],"rows":[]}', r"history record\.v: 2 is outside"),
    ('{"v":1,"interval_s":true,"fields":["t","step","world_size"],"rows":[]}',
     r"history record\.interval_s: expected float, got a boolean"),
    ('{"v":1,"interval_s":5,"fields":["t","step","world_size"],"rows":[[1,true,2]]}',
     r"history record\.rows\[0\]\.step: expected float, got a boolean"),
    ('{"v":1,"interval_s":5,"fields":["t","step","world_size"],"rows":[[1,null,2]]}',
     r"history record\.rows\[0\]\.step: expected float, got null"),
    ('{"v":1,"interval_s":5,"fields":["t","step","world_size"],"rows":[[1,2,Infinity]]}',
     r"history record\.rows\[0\]\.world_size: inf is not a finite number"),
    ('{"v":1,"interval_s":5,"fields":["t","step"],"rows":[]}', r"missing t, step or world_size"),
    ('{"v":1,"interval_s":5,"fields":["t","step","world_size"],"rows":' + "[" * 40 + "]" * 40 + "}", r"nest"),
])
def test_a_malformed_history_record_is_refused_naming_the_field(text, error):
    """A history record of another version, with a bool interval, a bool, null or
    infinite cell, missing columns or deep JSON is a ValueError naming the row and column."""
    from elasticd.history import History

    with pytest.raises(codec.RecordDecodeError, match=error):
        History.from_json(text)


def _deep(levels: int) -> list[object]:
    out: list[object] = []
    for _ in range(levels - 1):
        out = [out]
    return out


def _resealed(edit: dict[str, object]) -> bytes:
    """OLD_MANIFEST with ``edit`` applied and its self-checksum recomputed (a writer's bug,
    not a flipped byte: only the field checks can catch it)."""
    import json

    from elasticd.checkpoint.manifest import _canonical, checksum

    body = json.loads(OLD_MANIFEST)
    body.pop("manifest_crc32")
    body.update(edit)
    body["manifest_crc32"] = f"{checksum(_canonical(body)):08x}"
    return json.dumps(body).encode()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("edit", "error"), [
    ({"world_size": True}, r"manifest\.world_size: expected int, got a boolean"),
    ({"step": 10**12}, r"manifest\.step: 1000000000000 is outside"),
    ({"created_at": -1}, r"manifest\.created_at: -1\.0 is outside"),
    ({"files": [{"name": "state.pt", "size": "1", "crc32": "deadbeef"}]},
     r"manifest\.files\[0\]\.size: expected int, got a string"),
    ({"files": [{"name": "../x", "size": 1, "crc32": "deadbeef"}]}, r"manifest\.files\[0\]: file name '\.\./x'"),
    ({"files": [{"name": "state.pt", "size": 1, "crc32": "DEADBEEF"}]}, r"malformed crc32"),
    ({"parts": [1]}, r"manifest\.parts\[0\]: expected str, got a number"),
    ({"sampler": [1]}, r"manifest\.sampler: expected an object, got an array"),
    ({"pad": _deep(40)}, r"not valid JSON .*nest"),
])
def test_a_malformed_manifest_is_refused_naming_the_field(edit, error):
    """A manifest whose checksum holds but whose fields do not (a bool, a step past 12
    digits, a negative time, a string size, an unsafe name, an upper-case CRC, a non-string
    part, an array sampler) is CheckpointCorruptError naming the field."""
    from elasticd.checkpoint.api import CheckpointCorruptError
    from elasticd.checkpoint.manifest import Manifest

    with pytest.raises(CheckpointCorruptError, match=error):
        Manifest.from_json(_resealed(edit))



@pytest.mark.parametrize(("raw", "error"), [
    (b'{"node":"n","host":"h","pid":true,"version":"v","started_at":1}', r"NodeRecord\.pid: expected int, got a boolean"),
    (b'{"node":"n","host":"h","pid":1,"version":"v","started_at":Infinity}', r"NodeRecord\.started_at: inf is not a finite"),
    (b'{"node":"n","host":"h","pid":1,"version":"v","started_at":1,"ranks":["0"]}', r"NodeRecord\.ranks\[0\]: expected int"),
    (b'{"node":"n"}', r"NodeRecord: field 'host' is missing"),
    (b'{"round":1,"step":2,"samples_per_s":NaN}', r"Progress\.samples_per_s: nan is not a finite"),
])
def test_etcd_records_decode_through_the_one_codec_naming_record_and_field(raw, error):
    """records.py's from_json is elasticd.codec's decode: a RecordError that names the
    record and the field (nested index included); floats must be finite."""
    from elasticd.records import NodeRecord, Progress, RecordError

    cls = Progress if raw.startswith(b'{"round"') else NodeRecord
    with pytest.raises(RecordError, match=error):
        cls.from_json(raw)
