"""`elasticd status` against a real etcd: exit codes, JSON schema, 1,000 nodes, outages, watch."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time

import jsonschema
import pytest
from synthetic_job import SyntheticJob, write_synthetic_job

from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys
from elasticd.records import Event
from elasticd.status import jsondoc
from elasticd.status.cli import build_parser, run
from elasticd.status.snapshot import read_job

SCHEMA = jsondoc.load_schema()


def status(endpoint: str, *argv: str, timeout: str = "2") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = build_parser().parse_args(["status", "--etcd", endpoint, "--timeout", timeout, *argv])
    code = run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def status_json(endpoint: str, *argv: str) -> tuple[int, dict, str]:
    code, out, err = status(endpoint, "--json", *argv)
    doc = json.loads(out)
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    return code, doc, err


class CountingClient(EtcdClient):
    """An EtcdClient that counts range reads."""

    reads = 0

    def get_prefix(self, prefix):
        self.reads += 1
        return super().get_prefix(prefix)


@pytest.mark.timeout(60)
def test_unknown_job_exits_3_with_one_line(etcd_server, etcd_client):
    """A job with no keys exits 3, says so in one stderr line, and --json gives an error doc."""
    write_synthetic_job(etcd_client, SyntheticJob("other", nodes=2, events=3), now=time.time())
    code, out, err = status(etcd_server.endpoint, "--job", "nope")
    assert code == 3 and out == ""
    assert err.count("\n") == 1 and "job 'nope' unknown" in err
    code, doc, _ = status_json(etcd_server.endpoint, "--job", "nope")
    assert code == 3 and doc["kind"] == "error" and doc["exit_code"] == 3


@pytest.mark.timeout(60)
def test_thousand_node_job_is_one_range_read_and_right(etcd_server, etcd_client):
    """1,000 nodes (2 lost, 3 waiting) are read in ONE range request and reported correctly."""
    now = time.time()
    write_synthetic_job(etcd_client, SyntheticJob("big", nodes=1000, lost=2, waiting=3), now=now)
    counting = CountingClient(etcd_server.endpoint, timeout_s=5)
    try:
        snap = read_job(counting, "big")
    finally:
        counting.close()
    assert counting.reads == 1
    assert len(snap.nodes) == 998 + 3 and len(snap.events) == 258

    code, doc, err = status_json(etcd_server.endpoint, "--job", "big", "--events", "5")
    assert code == 1 and "degraded: 2 member(s) of round 12 lost" in err
    job = doc["job"]
    assert (job["state"], job["round"], job["nodes"], job["max_nodes"]) == ("re-forming", 12, 1000, 1000)
    assert job["world_size"] == 8000 and job["waiting_nodes"] == 3
    assert job["reason"] == "2 member(s) of round 12 lost: node-0998, node-0999"
    states = [n["state"] for n in doc["nodes"]]
    assert len(states) == 1003 and states.count("lost") == 2 and states.count("joining") == 3
    assert doc["nodes"][0]["ranks"] == list(range(8)) and doc["nodes"][0]["member"]
    assert [e["kind"] for e in doc["events"]][-2:] == ["lost", "lost"] and len(doc["events"]) == 5
    assert doc["progress"]["step"] == 123_456 and doc["progress"]["samples_per_s"] == 8192.5
    assert doc["checkpoint"]["step"] == 123_000
    assert doc["checkpoint"]["url"] == "s3://ckpt/big/step-123000/manifest.json"


@pytest.mark.timeout(60)
def test_exit_codes_follow_job_health(etcd_server, etcd_client):
    """Health is about now: full size -> 0 even right after a failure; below max -> 1;
    a lost member -> re-forming, 1; no round at all -> 2 (one stderr line each)."""
    now = time.time()
    write_synthetic_job(etcd_client, SyntheticJob("full", nodes=4, events=20), now=now)
    write_synthetic_job(etcd_client, SyntheticJob("small", nodes=3, max_nodes=4, events=20), now=now)
    write_synthetic_job(etcd_client, SyntheticJob("flaky", nodes=4, events=20, recent_failure=True),
                        now=now)
    write_synthetic_job(etcd_client, SyntheticJob("broken", nodes=4, lost=1, events=20), now=now)
    etcd_client.delete(JobKeys("small").rdzv_state)  # agents alive, no round formed
    ep = etcd_server.endpoint
    assert status(ep, "--job", "full")[0] == 0 and status(ep, "--job", "full")[2] == ""
    code, _, err = status(ep, "--job", "flaky")
    assert code == 0 and err == ""
    code, _, err = status(ep, "--job", "broken")
    assert code == 1 and err.strip().endswith("degraded: 1 member(s) of round 12 lost: node-0003")
    code, _, err = status(ep, "--job", "small")
    assert code == 2 and err.count("\n") == 1 and "no round formed yet" in err


@pytest.mark.timeout(60)
def test_job_list_is_one_read_and_lists_every_job(etcd_server, etcd_client):
    """Without --job every job is listed, as a table and as a valid job_list document."""
    now = time.time()
    write_synthetic_job(etcd_client, SyntheticJob("alpha", nodes=3, events=5), now=now)
    write_synthetic_job(etcd_client, SyntheticJob("beta", nodes=3, lost=1, events=5), now=now)
    code, out, _ = status(etcd_server.endpoint)
    assert code == 0
    lines = out.splitlines()
    assert any(ln.startswith("alpha") and "training" in ln for ln in lines)
    assert any(ln.startswith("beta") and "re-forming" in ln for ln in lines)
    code, doc, _ = status_json(etcd_server.endpoint)
    assert [(j["name"], j["exit_code"]) for j in doc["jobs"]] == [("alpha", 0), ("beta", 1)]
    assert doc["jobs"][0]["step"] == 123_456


@pytest.mark.timeout(60)
def test_expired_leases_turn_members_lost_then_job_stopped(etcd_server, etcd_client):
    """Node records vanish with their lease: status shows the job stopped, last event named."""
    lease = write_synthetic_job(etcd_client, SyntheticJob("gone", nodes=3, events=5), now=time.time())
    assert status(etcd_server.endpoint, "--job", "gone")[0] == 0
    etcd_client.revoke_lease(lease)  # what expiry does, without waiting a TTL
    code, doc, _ = status_json(etcd_server.endpoint, "--job", "gone")
    assert code == 2 and doc["job"]["state"] == "stopped"
    assert doc["job"]["reason"].startswith("no live agents; last event:")
    assert [n["state"] for n in doc["nodes"]] == ["lost"] * 3


@pytest.mark.timeout(30)
def test_stopped_etcd_exits_4_within_timeout(etcd_server):
    """With etcd stopped, status answers 4 with one line, well within --timeout."""
    etcd_server.stop()
    t0 = time.monotonic()
    code, out, err = status(etcd_server.endpoint, "--job", "x", timeout="1.5")
    assert code == 4 and time.monotonic() - t0 < 1.5 + 1.0
    assert err.count("\n") == 1 and "etcd unreachable" in err and out == ""


@pytest.mark.timeout(30)
def test_paused_etcd_exits_4_within_timeout(etcd_server, etcd_client):
    """A frozen etcd (SIGSTOP) makes status exit 4 after --timeout, never hang."""
    write_synthetic_job(etcd_client, SyntheticJob("j", nodes=2, events=2), now=time.time())
    etcd_server.pause()
    try:
        t0 = time.monotonic()
        code, doc, err = status_json(etcd_server.endpoint, "--job", "j", "--timeout", "1.5")
        elapsed = time.monotonic() - t0
    finally:
        etcd_server.resume()
    assert code == 4 and 1.0 <= elapsed < 1.5 + 1.0
    assert doc["kind"] == "error" and doc["exit_code"] == 4 and "unreachable" in err


class _Buffer(io.StringIO):
    """A StringIO another thread can read while the watch loop writes."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            return super().write(s)

    def lines(self) -> list[str]:
        with self.lock:
            return self.getvalue().splitlines()


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.timeout(60)
def test_watch_json_prints_a_document_per_change(etcd_server, etcd_client):
    """--watch --json prints the state, then a new document when a node's record vanishes."""
    write_synthetic_job(etcd_client, SyntheticJob("w", nodes=3, events=5), now=time.time())
    out, err, stop = _Buffer(), io.StringIO(), threading.Event()
    args = build_parser().parse_args(["status", "--etcd", etcd_server.endpoint, "--job", "w",
                                      "--json", "--watch"])
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(run(args, out=out, err=err, stop=stop)))
    t.start()
    try:
        def states() -> list[str]:
            return [json.loads(line)["job"]["state"] for line in out.lines()]

        assert wait_for(lambda: states()[:1] == ["training"], 10)
        keys = JobKeys("w")
        etcd_client.delete(keys.node("node-0001"))  # its lease "expired"
        etcd_client.put(keys.event(5000), Event(time=time.time(), kind="lost", node="node-0001",
                                                round=12, message="lease expired").to_json())
        assert wait_for(lambda: "re-forming" in states(), 10), out.lines()
        last = json.loads(out.lines()[-1])
        jsonschema.Draft202012Validator(SCHEMA).validate(last)
        assert {n["node"]: n["state"] for n in last["nodes"]}["node-0001"] == "lost"
    finally:
        stop.set()
        t.join(timeout=10)
    assert codes == [0] and not t.is_alive()


@pytest.mark.timeout(60)
def test_watch_table_redraws_when_not_a_terminal(etcd_server, etcd_client):
    """--watch to a pipe prints a plain full screen per change (no cursor control)."""
    write_synthetic_job(etcd_client, SyntheticJob("p", nodes=2, events=2), now=time.time())
    out, stop = _Buffer(), threading.Event()
    args = build_parser().parse_args(["status", "--etcd", etcd_server.endpoint, "--job", "p",
                                      "--watch"])
    t = threading.Thread(target=run, args=(args,), kwargs={"out": out, "err": io.StringIO(),
                                                           "stop": stop})
    t.start()
    try:
        assert wait_for(lambda: any("watching revision" in ln for ln in out.lines()), 10)
        etcd_client.delete(JobKeys("p").node("node-0000"))
        assert wait_for(lambda: any("RE-FORMING" in ln for ln in out.lines()), 10)
    finally:
        stop.set()
        t.join(timeout=10)
    assert "\x1b[" not in "".join(out.lines())


@pytest.mark.timeout(60)
def test_watch_started_before_the_job_waits_for_it(etcd_server, etcd_client):
    """--watch on a job that does not exist yet says it waits, prints nothing until the
    job's keys appear, then follows the job (a watch started first is not an error)."""
    out, err, stop = _Buffer(), _Buffer(), threading.Event()
    args = build_parser().parse_args(["status", "--etcd", etcd_server.endpoint, "--job", "late",
                                      "--json", "--watch"])
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(run(args, out=out, err=err, stop=stop)))
    t.start()
    try:
        assert wait_for(lambda: any("waiting for job late" in ln for ln in err.lines()), 10)
        assert out.lines() == [] and t.is_alive()
        write_synthetic_job(etcd_client, SyntheticJob("late", nodes=2, events=2), now=time.time())
        assert wait_for(lambda: any(json.loads(ln)["kind"] == "job" for ln in out.lines()), 10)
        assert all(json.loads(ln)["kind"] == "job" for ln in out.lines())
    finally:
        stop.set()
        t.join(timeout=10)
    assert codes == [0] and not t.is_alive()


@pytest.mark.timeout(60)
def test_command_line_process_prints_80_column_table_and_exit_code(etcd_server, etcd_client):
    """`python -m elasticd.status` in a pipe: plain 80-column text, exit 1, one stderr line."""
    write_synthetic_job(etcd_client, SyntheticJob("cli", nodes=3, max_nodes=5, events=12),
                        now=time.time())
    env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    proc = subprocess.run([sys.executable, "-m", "elasticd.status", "--etcd", etcd_server.endpoint,
                           "--job", "cli"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "elasticd status: job cli degraded: 3 of max 5 nodes"]
    lines = proc.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 80 and "\x1b[" not in proc.stdout
    assert sum(ln.startswith("node-000") for ln in lines) == 3


@pytest.mark.timeout(60)
def test_a_closed_pipe_is_a_normal_exit(etcd_server, etcd_client):
    """`elasticd status --json | head` whose reader has gone: exit 0, nothing on stderr
    (no "internal error", no traceback)."""
    write_synthetic_job(etcd_client, SyntheticJob("piped", nodes=3, max_nodes=5, events=12),
                        now=time.time())
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before status writes a byte
    try:
        for argv in (["--json"], ["--json", "--job", "piped"], ["--job", "piped"]):
            proc = subprocess.run([sys.executable, "-m", "elasticd.cli", "status", "--etcd",
                                   etcd_server.endpoint, *argv], stdout=write_end,
                                  stderr=subprocess.PIPE, text=True, timeout=30)
            assert (proc.returncode, proc.stderr) == (0, ""), (argv, proc.stderr)
    finally:
        os.close(write_end)


@pytest.mark.timeout(60)
def test_job_over_grpc_default_limit_is_read_in_one_request(etcd_server, etcd_client):
    """A job whose keys exceed gRPC's default 4 MB response limit is read in one request
    (the client raises the limit; the store-less fallback is for jobs past that)."""
    write_synthetic_job(etcd_client, SyntheticJob("fat", nodes=4, events=5), now=time.time())
    for i in range(4):  # 4 x 1.2 MB of c10d store: the one-read path would be refused
        etcd_client.put(f"{JobKeys('fat').store_prefix(12)}blob{i}", b"x" * 1_200_000)
    counting = CountingClient(etcd_server.endpoint, timeout_s=5)
    try:
        snap = read_job(counting, "fat")
    finally:
        counting.close()
    assert counting.reads == 1 and len(snap.nodes) == 4
    code, doc, err = status_json(etcd_server.endpoint, "--job", "fat")
    assert code == 0 and doc["job"]["state"] == "training" and err == ""


@pytest.mark.timeout(60)
def test_watch_job_list_json_follows_new_jobs(etcd_server, etcd_client):
    """--watch --json without --job prints a job_list document that grows when a job appears."""
    write_synthetic_job(etcd_client, SyntheticJob("first", nodes=2, events=2), now=time.time())
    out, stop = _Buffer(), threading.Event()
    args = build_parser().parse_args(["status", "--etcd", etcd_server.endpoint, "--json",
                                      "--watch"])
    t = threading.Thread(target=run, args=(args,), kwargs={"out": out, "err": io.StringIO(),
                                                           "stop": stop})
    t.start()
    try:
        def names() -> list[list[str]]:
            return [[j["name"] for j in json.loads(ln)["jobs"]] for ln in out.lines()]

        assert wait_for(lambda: ["first"] in names(), 10)
        write_synthetic_job(etcd_client, SyntheticJob("second", nodes=2, events=2),
                            now=time.time())
        assert wait_for(lambda: ["first", "second"] in names(), 10), names()
        jsonschema.Draft202012Validator(SCHEMA).validate(json.loads(out.lines()[-1]))
    finally:
        stop.set()
        t.join(timeout=10)
    assert not t.is_alive()
