"""Admission (issue 24 item 1): an agent started with another program under a running
job's name is refused with exit 78 before it touches a round; the job trains on untouched.
The executor against real etcd: publish, confirm, refuse, replace once no live agent
holds the old fingerprint, and two different programs starting at once."""

from __future__ import annotations

import threading

import pytest
from harness import ROOT, read_jsonl, wait_until

from elasticd.agent.admission import (
    AdmissionRefusedError,
    AdmissionVerdict,
    admit,
    make_fingerprint,
    precheck,
)
from elasticd.keys import JobKeys
from elasticd.records import JobFingerprint, NodeRecord

SCRIPT = ROOT / "tests" / "workers" / "plain_ddp.py"
pytestmark = pytest.mark.timeout(180)


def _env(tmp_path, node: str, epochs: int) -> dict[str, str]:
    return {"SNAPSHOT": str(tmp_path / f"snap-{node}.pt"), "OUT": str(tmp_path / f"{node}.jsonl"),
            "EPOCHS": str(epochs), "EPOCH_S": "0.2"}


def test_foreign_program_is_refused_and_the_job_trains_on(nodes, etcd_client, tmp_path):
    """n0 trains job J; n1 started under J with another script (same name, other content)
    exits 78 naming both commands and the fix, never registers, and n0's round and training
    go on as before."""
    job = "adm"
    other = tmp_path / "elsewhere" / "plain_ddp.py"  # another program under the same name
    other.parent.mkdir()
    other.write_text(SCRIPT.read_text() + "\n# another model\n")
    kw = {"nnodes": "1:2", "extra": ["--restart-backoff", "0.1"]}
    a = nodes.start(job, str(SCRIPT), env=_env(tmp_path, "n0", 1000), name="n0", **kw)
    out_a = tmp_path / "n0.jsonl"
    wait_until(lambda: len(read_jsonl(out_a)) >= 2, 60, "n0 trains")

    b = nodes.start(job, str(other), env=_env(tmp_path, "n1", 3), name="n1", **kw)
    assert b.wait(60) == 78, b.log()[-3000:]
    log_b = b.log()
    assert "is running another program" in log_b, log_b[-3000:]
    assert str(SCRIPT) in log_b and str(other) in log_b, log_b[-3000:]
    assert "script's content differs" in log_b and "--job" in log_b, log_b[-3000:]
    assert f"elasticd stop --job {job}" in log_b, log_b[-3000:]
    # Refused before it registered (agent.boot's precheck): nothing of the job touched.
    assert "node_registered" not in log_b and "agent_started" not in log_b, log_b[-3000:]
    assert not (tmp_path / "n1.jsonl").exists()

    # The job trains on at world 1, in the same round: no re-formation, no restart.
    rows = len(read_jsonl(out_a))
    wait_until(lambda: len(read_jsonl(out_a)) >= rows + 3, 30, "n0 trains on")
    assert all(r["world"] == 1 for r in read_jsonl(out_a))
    assert a.log().count('"event": "rendezvous_completed"') == 1, a.log()[-3000:]
    kv = etcd_client.get(JobKeys(job).fingerprint)
    assert kv is not None
    stored = JobFingerprint.from_json(kv.value)
    assert stored.command[0] == str(SCRIPT) and stored.node == "n0"



def _record(etcd_client, keys: JobKeys, node: str, digest: str) -> int:
    """A live node record carrying ``digest``, on a fresh lease (returned)."""
    lease = etcd_client.grant_lease(30)
    rec = NodeRecord(node=node, host="h", pid=1, version="v", started_at=0.0, fingerprint=digest)
    etcd_client.put(keys.node(node), rec.to_json(), lease=lease)
    return lease


def _fp(tmp_path, name: str, body: str) -> JobFingerprint:
    path = tmp_path / name
    path.write_text(body)
    return make_fingerprint([str(path)], min_nodes=1, max_nodes=2, checkpoint_url=None,
                            live_reform=True, node=name)


def test_admission_against_etcd_publish_refuse_replace(etcd_client, tmp_path):
    """The first agent publishes; the same program is confirmed; another is refused while
    a live record holds the job's digest and replaces it once none does."""
    keys = JobKeys("adm2")
    job, foreign = _fp(tmp_path, "a.py", "a\n"), _fp(tmp_path, "b.py", "b\n")
    lease = _record(etcd_client, keys, "n0", job.digest)
    assert admit(etcd_client, keys, "n0", job).verdict is AdmissionVerdict.PUBLISH
    assert admit(etcd_client, keys, "n1", job).verdict is AdmissionVerdict.MATCH
    with pytest.raises(AdmissionRefusedError, match="n0"):
        precheck(etcd_client, keys, "n2", foreign)
    with pytest.raises(AdmissionRefusedError):
        admit(etcd_client, keys, "n2", foreign)
    assert JobFingerprint.from_json(etcd_client.get(keys.fingerprint).value) == job
    etcd_client.revoke_lease(lease)  # the run ended: its last agent is gone
    done = admit(etcd_client, keys, "n2", foreign)
    assert done.verdict is AdmissionVerdict.REPLACE and done.replaced == job
    assert JobFingerprint.from_json(etcd_client.get(keys.fingerprint).value) == foreign


def test_two_programs_starting_at_once_one_is_refused(etcd_client, tmp_path):
    """Agents of two programs registering and deciding at the same time: exactly one set
    is admitted (every admission is a txn on the key's revision)."""
    keys = JobKeys("adm3")
    fps = {f"n{i}": _fp(tmp_path, f"{'ab'[i % 2]}.py", f"{'ab'[i % 2]}\n") for i in range(6)}
    for node, fp in fps.items():
        _record(etcd_client, keys, node, fp.digest)
    outcome: dict[str, str] = {}
    start = threading.Barrier(len(fps))

    def one(node: str) -> None:
        start.wait(10)
        try:
            admit(etcd_client, keys, node, fps[node])
            outcome[node] = "admitted"
        except AdmissionRefusedError:
            outcome[node] = "refused"

    threads = [threading.Thread(target=one, args=(n,)) for n in fps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    admitted = {fps[n].digest for n, o in outcome.items() if o == "admitted"}
    assert len(outcome) == len(fps) and len(admitted) == 1, outcome
    stored = JobFingerprint.from_json(etcd_client.get(keys.fingerprint).value)
    assert admitted == {stored.digest}
