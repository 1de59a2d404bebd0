"""Unit tests of the --json documents: schema validity, exact field sets, times, redaction."""

from __future__ import annotations

import io
import json
import re

import jsonschema
import pytest

from elasticd.records import CheckpointPointer, Event, NodeRecord, Progress, RoundState
from elasticd.status import jsondoc
from elasticd.status.model import derive_status
from elasticd.status.render import make_console, render_job
from elasticd.status.snapshot import JobSnapshot, SeqEvent

NOW = 1_750_000_000.0
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture(scope="module")
def schema():
    s = jsondoc.load_schema()
    jsonschema.Draft202012Validator.check_schema(s)
    return s


def validate(doc, schema):
    jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(doc)


def full_snapshot() -> JobSnapshot:
    rs = RoundState(round=3, phase="final", members=["a", "b"], min_nodes=1, max_nodes=2,
                    opened_at=NOW - 20, completed_at=NOW - 10)
    nodes = (NodeRecord(node="a", host="h-a", pid=1, version="0.1.0", started_at=NOW - 99,
                        state="training", round=3, ranks=[0, 1], heartbeat_at=NOW - 1,
                        local_world_size=2),)
    events = (SeqEvent(1, Event(time=NOW - 5, kind="failure", node="b", round=3,
                                message="worker exited",
                                detail={"exit_code": 1, "aws_secret_access_key": "AKIA...",
                                        "nested": {"password": "p"}, "rank": 3})),
              SeqEvent(2, Event(time=NOW - 4, kind="lost", node="b", round=3,
                                message="lease expired")))
    return JobSnapshot(
        job="demo", revision=77, round_state=rs, nodes=nodes, events=events,
        progress=Progress(round=3, step=100, epoch=1, samples_trained=6400, samples_per_s=64.0,
                          world_size=4, updated_at=NOW - 1),
        checkpoint=CheckpointPointer(step=90, round=3, committed_at=NOW - 30, world_size=4,
                                     manifest_url="https://u:pw@store.example/c/90/manifest.json"
                                                  "?sig=s3cr3t&expires=1"))


def keys_of(schema: dict, name: str) -> set[str]:
    return set(schema["$defs"][name]["required"])


def test_job_document_validates_and_has_exactly_the_documented_fields(schema):
    """A job document passes the schema and carries no undocumented field."""
    doc = jsondoc.job_document(derive_status(full_snapshot(), NOW), endpoints=["127.0.0.1:2379"])
    validate(doc, schema)
    assert set(doc) == keys_of(schema, "job_document")
    assert set(doc["job"]) == keys_of(schema, "job")
    assert set(doc["progress"]) == keys_of(schema, "progress")
    assert set(doc["checkpoint"]) == keys_of(schema, "checkpoint")
    assert all(set(n) == keys_of(schema, "node") for n in doc["nodes"])
    assert all(set(e) == keys_of(schema, "event") for e in doc["events"])
    assert doc["schema_version"] == 1 and doc["kind"] == "job"
    assert doc["job"]["state"] == "re-forming" and doc["job"]["exit_code"] == 1
    assert [n["state"] for n in doc["nodes"]] == ["training", "lost"]
    assert doc["nodes"][1]["lost_at"] == jsondoc.rfc3339(NOW - 4)


def test_times_are_rfc3339_utc(schema):
    """Every time field is an RFC 3339 UTC string with millisecond precision."""
    doc = jsondoc.job_document(derive_status(full_snapshot(), NOW), endpoints=[])
    times = [doc["generated_at"], doc["job"]["round_opened_at"], doc["job"]["round_completed_at"],
             doc["progress"]["updated_at"], doc["checkpoint"]["committed_at"],
             doc["nodes"][0]["heartbeat_at"], doc["nodes"][0]["started_at"],
             *(e["time"] for e in doc["events"])]
    assert all(RFC3339_UTC.match(t) for t in times), times
    assert jsondoc.rfc3339(0.0) == "1970-01-01T00:00:00.000Z"
    assert doc["checkpoint"]["age_s"] == 30.0


def test_no_secrets_in_the_document():
    """URL userinfo, query values and credential-named detail entries never appear."""
    text = json.dumps(jsondoc.job_document(derive_status(full_snapshot(), NOW), endpoints=[]))
    for secret in ("pw@", "s3cr3t", "AKIA", '"p"'):
        assert secret not in text
    doc = json.loads(text)
    assert doc["checkpoint"]["url"] == ("https://***@store.example/c/90/manifest.json"
                                        "?sig=<redacted>&expires=<redacted>")
    assert doc["events"][0]["detail"]["rank"] == 3 and doc["events"][0]["exit"] == "exit 1"


def test_empty_job_document_validates(schema):
    """A job with no round, progress, checkpoint or events still validates (nulls, not gaps)."""
    snap = JobSnapshot(job="j", revision=1, nodes=(NodeRecord(node="n", host="h", pid=1,
                                                                 version="v", started_at=0.0),))
    doc = jsondoc.job_document(derive_status(snap, NOW), endpoints=[])
    validate(doc, schema)
    assert doc["progress"] is None and doc["checkpoint"] is None and doc["job"]["round"] is None
    assert doc["nodes"][0]["heartbeat_at"] is None


def test_job_list_and_error_documents_validate(schema):
    """The job-list and error documents pass the same schema."""
    statuses = [derive_status(full_snapshot(), NOW)]
    doc = jsondoc.job_list_document(statuses, endpoints=["e:1"], revision=5, now=NOW)
    validate(doc, schema)
    assert set(doc["jobs"][0]) == keys_of(schema, "job") | keys_of(schema, "job_list_entry")
    assert doc["jobs"][0]["checkpoint_step"] == 90
    err = jsondoc.error_document(4, "etcd unreachable", job="demo", endpoints=["e:1"], now=NOW)
    validate(err, schema)
    assert set(err) == keys_of(schema, "error_document")
    with pytest.raises(jsonschema.ValidationError):
        validate({**err, "exit_code": 0}, schema)


def test_a_spare_says_why_in_json_and_in_the_table(schema):
    """A node in state spare carries its record's reason (`spare_reason`, and a note under
    the nodes table); other nodes have null."""
    snap = full_snapshot()
    why = "the job is at its largest valid size (2 nodes; valid sizes 1,2)"
    spare = NodeRecord(node="c", host="h-c", pid=3, version="0.1.0", started_at=NOW - 50,
                       state="spare", heartbeat_at=NOW - 1, spare_reason=why)
    snap = JobSnapshot(job=snap.job, revision=snap.revision, round_state=snap.round_state,
                       nodes=(*snap.nodes, spare), events=snap.events, progress=snap.progress,
                       checkpoint=snap.checkpoint)
    status = derive_status(snap, NOW)
    doc = jsondoc.job_document(status, endpoints=["127.0.0.1:2379"])
    validate(doc, schema)
    reasons = {n["node"]: n["spare_reason"] for n in doc["nodes"]}
    assert reasons == {"a": None, "b": None, "c": why}
    buf = io.StringIO()
    make_console(buf, width=120).print(render_job(status))
    assert f"c is a spare: {why}" in " ".join(buf.getvalue().split())


def test_the_auto_checkpoint_cadence_is_shown_in_json_and_in_the_table(schema):
    """A progress record carrying [checkpoint] every = "auto"'s choice shows it: JSON
    progress.checkpoint_cadence (steps, seconds, why) and a `cadence` row; without one
    the JSON field is null and there is no row."""
    from dataclasses import replace

    snap = full_snapshot()
    why = "12.0 s: Young–Daly sqrt(2 * blocking * MTBF) (blocking 0.02 s, write 1 s, MTBF 3600 s)"
    auto = replace(snap, progress=replace(snap.progress, save_every=24, save_interval_s=12.0,
                                          cadence=why))
    status = derive_status(auto, NOW)
    doc = jsondoc.job_document(status, endpoints=["127.0.0.1:2379"])
    validate(doc, schema)
    assert doc["progress"]["checkpoint_cadence"] == {"every_steps": 24, "interval_s": 12.0,
                                                     "reason": why}
    buf = io.StringIO()
    make_console(buf, width=200).print(render_job(status))
    text = " ".join(buf.getvalue().split())
    assert "cadence auto: every 24 steps (~12.0 s)" in text and "Young–Daly" in text
    plain = derive_status(snap, NOW)
    assert jsondoc.job_document(plain, endpoints=[])["progress"]["checkpoint_cadence"] is None
    buf = io.StringIO()
    make_console(buf, width=200).print(render_job(plain))
    assert "cadence" not in buf.getvalue()
