"""`elasticd stop` / `drain` / `start` against real etcd and real agents: the whole job or
one node drains at a step boundary, a stopped job stays stopped, bad names touch nothing."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from harness import ROOT, read_jsonl, rows_after, wait_until

from elasticd.cli import main
from elasticd.keys import JobKeys

SCRIPT = str(ROOT / "tests" / "workers" / "drainable.py")


def _worker_env_tests():
    # The TLS+auth etcd fixture lives in test_worker_env.py (tests/integration is no package).
    path = Path(__file__).with_name("test_worker_env.py")
    spec = importlib.util.spec_from_file_location("elasticd_test_worker_env", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_ENV_TESTS = _worker_env_tests()
auth_etcd = _ENV_TESTS.auth_etcd  # a fixture: etcd over TLS with auth, user root / SECRET
SECRET = _ENV_TESTS.SECRET
pytestmark = pytest.mark.timeout(240)


def _env(tmp_path):
    # Periodic saves off: the only checkpoint is the one the stop/drain takes.
    return {"OUT": str(tmp_path / "steps.jsonl"), "CKPT": str(tmp_path / "ckpt.json"),
            "STEP_S": "0.05", "CKPT_EVERY": "100000"}


def _world_rows(out, world):
    return [r for r in read_jsonl(out) if r["world"] == world]


def test_drain_then_stop_lose_no_step_and_keep_nodes_out(nodes, tmp_path, capsys):
    """One 2-node job, driven from the CLI. `drain --node n1`: n1 exits 0, n0 goes on at
    world 1 from exactly the next step, and a relaunched n1 exits 0 without joining (and
    says how to clear it) until `start --node n1`. After n1 rejoined, `stop`: both agents
    exit 0, every rank's last step is the same, the checkpoint is at that step, and the
    job stays stopped until `start`."""
    env, out, ep, job = _env(tmp_path), tmp_path / "steps.jsonl", nodes.etcd.endpoint, "sd1"
    a = nodes.start(job, SCRIPT, env=env, nnodes="1:2", name="n0")
    b = nodes.start(job, SCRIPT, env=env, nnodes="1:2", name="n1")
    wait_until(lambda: len(_world_rows(out, 2)) >= 6, 120, "world 2 steps")

    assert main(["drain", "--job", job, "--node", "n1", "--etcd", ep, "--wait", "60"]) == 0
    captured = capsys.readouterr()
    assert "drained and left" in captured.out and "waiting for 1 node" in captured.err, captured
    assert b.wait(20) == 0, b.log()[-2000:]
    refused = nodes.start(job, SCRIPT, env=env, nnodes="1:2", name="n1")
    wait_until(lambda: len(rows_after(read_jsonl(out), 2, 1)) >= 3, 60, "steps at world 1")
    rows = read_jsonl(out)
    last_at_2 = max(r["step"] for r in rows if r["world"] == 2)
    assert min(r["step"] for r in rows_after(rows, 2, 1)) == last_at_2 + 1, "a step was lost"
    assert refused.wait(90) == 0, refused.log()[-2000:]
    assert "agent_not_joining" in refused.log()
    assert f"elasticd start --job {job} --node n1" in refused.log()
    assert a.alive()

    assert main(["start", "--job", job, "--node", "n1", "--etcd", ep]) == 0
    last_at_1 = max(r["step"] for r in read_jsonl(out) if r["world"] == 1)
    b2 = nodes.start(job, SCRIPT, env=env, nnodes="1:2", name="n1")
    wait_until(lambda: len([r for r in _world_rows(out, 2) if r["step"] > last_at_1]) >= 4, 120,
               "n1 back: world 2 steps")

    assert main(["stop", "--job", job, "--etcd", ep, "--wait", "60"]) == 0
    assert "stopped: every node left" in capsys.readouterr().out
    assert a.wait(20) == 0 and b2.wait(20) == 0, a.log()[-2000:] + b2.log()[-2000:]
    final = [r for r in read_jsonl(out) if r["step"] > last_at_1]
    last = {r["rank"]: r["step"] for r in final}
    assert len(last) == 2 and len(set(last.values())) == 1, f"ranks stopped apart: {last}"
    assert json.loads((tmp_path / "ckpt.json").read_text())["step"] == last[0]
    assert "agent_stopped_by_operator" in a.log()

    from elasticd.agent.remote_control import refusal_at_start
    from elasticd.etcd.client import EtcdClient

    client = EtcdClient(ep, timeout_s=2.0)
    try:
        kept_out = refusal_at_start(client, JobKeys(job), "n0")
        assert kept_out is not None and kept_out.node is None, "the job is not marked stopped"
        assert main(["start", "--job", job, "--etcd", ep]) == 0
        assert refusal_at_start(client, JobKeys(job), "n0") is None
    finally:
        client.close()


def test_unknown_job_or_node_is_refused_and_writes_nothing(etcd_client, etcd_server, capsys):
    """stop/drain/start of an unknown job, or drain of a node that is not live, exit 3
    with a message naming the problem and the fix, and leave etcd's revision unchanged."""
    keys = JobKeys("known")
    etcd_client.put(keys.run_id, "0123456789abcdef")
    etcd_client.put(keys.node("n0"), "{}")
    ep = etcd_server.endpoint
    _, before = etcd_client.get_prefix("/elasticd/")
    assert main(["stop", "--job", "nope", "--etcd", ep]) == 3
    assert "job 'nope' unknown" in capsys.readouterr().err
    assert main(["drain", "--job", "known", "--node", "ghost", "--etcd", ep]) == 3
    err = capsys.readouterr().err
    assert "node 'ghost' is not a live node" in err and "live: n0" in err, err
    assert main(["drain", "--job", "nope", "--node", "n0", "--etcd", ep]) == 3
    assert main(["start", "--job", "nope", "--etcd", ep]) == 3
    _, after = etcd_client.get_prefix("/elasticd/")
    assert after == before, "a refused command wrote to etcd"
    assert main(["stop", "--job", "bad/name", "--etcd", ep]) == 78


def test_stop_is_authorised_like_any_etcd_client(auth_etcd, tmp_path, capsys):
    """On an etcd with TLS and auth, `stop` without credentials is refused by etcd and
    writes nothing; with the status flags (CA, client cert, user, password file) it works."""
    from elasticd.etcd.client import EtcdClient, TLSFiles

    server, pki = auth_etcd
    tls = TLSFiles(pki.ca, pki.client_cert, pki.client_key)
    root = EtcdClient(server.endpoint, timeout_s=3.0, tls=tls, user="root", password=SECRET)
    pw = tmp_path / "pw"
    pw.write_text(SECRET)
    pw.chmod(0o600)
    tls_flags = ["--etcd", server.endpoint, "--etcd-ca", pki.ca, "--etcd-cert", pki.client_cert,
                 "--etcd-key", pki.client_key]
    try:
        keys = JobKeys("authjob")
        root.put(keys.run_id, "0123456789abcdef")
        code = main(["stop", "--job", "authjob", *tls_flags, "--wait", "0"])
        assert code == 78, "etcd let an unauthenticated client stop the job"
        assert "permission denied" in capsys.readouterr().err
        assert root.get(keys.stop_mark) is None
        assert main(["stop", "--job", "authjob", *tls_flags, "--etcd-user", "root",
                     "--etcd-password-file", str(pw), "--wait", "0"]) == 0
        assert root.get(keys.stop_mark) is not None
    finally:
        root.close()


def test_nodes_stopped_by_elasticd_stop_are_not_listed_as_lost(nodes, tmp_path, capsys):
    """A 2-node job stopped with `elasticd stop`: both agents exit 0, and `status --json`
    lists neither node as lost and shows no `lost` event (they left cleanly)."""
    env, out, ep, job = _env(tmp_path), tmp_path / "steps.jsonl", nodes.etcd.endpoint, "sd7"
    a = nodes.start(job, SCRIPT, env=env, nnodes="1:2", name="n0")
    b = nodes.start(job, SCRIPT, env=env, nnodes="1:2", name="n1")
    wait_until(lambda: len(_world_rows(out, 2)) >= 4, 120, "world 2 steps")
    assert main(["stop", "--job", job, "--etcd", ep, "--wait", "60"]) == 0
    assert a.wait(30) == 0 and b.wait(30) == 0, a.log()[-2000:] + b.log()[-2000:]
    capsys.readouterr()
    main(["status", "--job", job, "--etcd", ep, "--json", "--events", "50"])
    doc = json.loads(capsys.readouterr().out)
    states = {n["node"]: n["state"] for n in doc["nodes"]}
    assert "lost" not in states.values(), states
    assert not [e for e in doc["events"] if e["kind"] == "lost"], doc["events"]
