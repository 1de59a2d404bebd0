"""The control plane's trust boundaries, each closed against real parts: the embedded etcd
against another local uid, an agent under a per-job etcd role over TLS, credentials in the
clear, the worker log dir, NOSPACE, hostile records and the metrics bind address."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness import PY, Node, wait_until

from elasticd.errors import ConfigError
from elasticd.etcd.client import EtcdClient, TLSFiles
from elasticd.etcd.embedded import EmbeddedEtcd, ServerTLS, find_etcd_binary
from elasticd.keys import JobKeys
from elasticd.records import NodeRecord

# Only names that predate the security work are imported here, so that on the old code each
# test fails on the behaviour it pins, not on an import.

NOBODY = 65534
ETCDCTL = shutil.which("etcdctl") or os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")

WAIT_SCRIPT = """\
import os, sys, time
open(sys.argv[1], "w").close()
deadline = time.monotonic() + 90
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another uid (65534); run the suite as root")


def _etcdctl(endpoint: str, *args: str, uid: int | None = None, tls: list[str] | None = None,
             timeout_s: float = 15.0) -> subprocess.CompletedProcess[str]:
    argv = [ETCDCTL, f"--endpoints={endpoint}", "--dial-timeout=2s", "--command-timeout=3s",
            *(tls or []), *args]
    kw: dict = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "ETCDCTL_API": "3"}, **kw)


# Run as uid 65534: talk to an etcd peer port the way the attack of issue 21 did (GET /members
# for the cluster id, POST /raft with a raft message), over plain http and over TLS without a
# client certificate. Prints, per attempt, whether etcd's peer handler answered.
PEER_ATTACK = """\
import http.client, json, ssl, sys
port = int(sys.argv[1])
HTTPS_ONLY = "HTTP request to an HTTPS server"
out = {}
for scheme in ("http", "https"):
    for method, path, body in (("GET", "/members", None), ("POST", "/raft", b"\\xff")):
        what = f"{method} {scheme}://127.0.0.1:{port}{path}"
        try:
            if scheme == "http":
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
            else:
                ctx = ssl.create_default_context()
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
                conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=3, context=ctx)
            conn.request(method, path, body=body, headers={"X-Etcd-Cluster-ID": "1"})
            resp = conn.getresponse()
            text = resp.read(300).decode(errors="replace")
            out[what] = "refused" if HTTPS_ONLY in text else f"reached: {resp.status} {text[:120]}"
        except (OSError, http.client.HTTPException) as exc:
            out[what] = f"refused ({type(exc).__name__})"
print(json.dumps(out))
"""


def _attack_peer_port(port: int) -> dict[str, str]:
    """Run PEER_ATTACK as uid 65534 against ``port``; what each request got."""
    proc = subprocess.run(["/usr/bin/python3", "-c", PEER_ATTACK, str(port)], capture_output=True,
                          text=True, timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin"},
                          user=NOBODY, group=NOBODY, extra_groups=[])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _peer_port_from_cmdline(pid: int) -> int:
    """The peer port an etcd process listens on, read where any local user can: its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    url = argv[argv.index("--listen-peer-urls") + 1]
    return int(url.rsplit(":", 1)[1])


def _log_event(log: str, event: str) -> dict:
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            return rec
    raise AssertionError(f"no {event} in the agent's log:\n{log[-3000:]}")


@pytest.mark.timeout(150)
@pytest.mark.real_tmp  # uid 65534 must be kept out by the files' modes, not by pytest's 0700 root
def test_standalone_etcd_and_worker_logs_are_private_to_their_owner(tmp_path):
    """`elasticd run --standalone`: uid 65534 can neither read nor write a key of its etcd
    (plaintext, TLS without a client cert, or the owner's cert files), while the owner can,
    nor reach its peer port (GET /members, POST /raft over http and TLS without a cert);
    a log dir another user made first at the old predictable path is not used, and the
    chosen one is the owner's, mode 0700, and logged."""
    _need_root()
    job = f"sec-{os.getpid()}-{int(time.time())}"
    trap = Path(tempfile.gettempdir()) / f"elasticd-logs-{job}"  # the old predictable path
    trap.mkdir()
    os.chown(trap, NOBODY, NOBODY)
    trap.chmod(0o777)
    script = tmp_path / "wait.py"
    script.write_text(WAIT_SCRIPT)
    started, release = tmp_path / "started", tmp_path / "release"
    node = Node([PY, "-m", "elasticd.cli", "run", "--standalone", "--job", job, "--log-format",
                 "json", str(script), str(started), str(release)], {}, tmp_path / "agent.log")
    try:
        wait_until(lambda: started.exists() or not node.alive(), 90, "the worker to start")
        assert node.alive(), node.log()[-3000:]
        etcd_rec = _log_event(node.log(), "embedded_etcd_started")
        endpoint = etcd_rec["endpoint"]
        key = JobKeys(job).checkpoint_latest
        tls_dir = etcd_rec.get("tls_dir") or str(tmp_path / "no-tls-dir")
        owner_tls = [f"--cacert={tls_dir}/ca.pem", f"--cert={tls_dir}/client.pem",
                     f"--key={tls_dir}/client-key.pem"]
        attempts = {
            "plaintext": (f"http://{endpoint}", []),
            "tls without a client certificate": (f"https://{endpoint}", ["--insecure-transport=false",
                                                                         "--insecure-skip-tls-verify"]),
            "the owner's certificate files": (f"https://{endpoint}", owner_tls),
        }
        for what, (url, tls) in attempts.items():
            put = _etcdctl(url, "put", key, '{"step": 999999}', uid=NOBODY, tls=tls)
            assert put.returncode != 0, f"uid {NOBODY} wrote {key} over {what}: {put.stdout}"
            get = _etcdctl(url, "get", "--prefix", "/", uid=NOBODY, tls=tls)
            assert get.returncode != 0 and "/elasticd/" not in get.stdout, \
                f"uid {NOBODY} read keys over {what}: {get.stdout[:300]}"
        # The owner gets through: the endpoint was right, so the refusals above are real.
        mine = _etcdctl(f"https://{endpoint}", "get", "--prefix", "--keys-only", JobKeys(job).prefix,
                        tls=owner_tls)
        assert mine.returncode == 0 and JobKeys(job).nodes_prefix in mine.stdout, mine.stderr
        # The server key is on disk (etcd reads it), readable by the owner's uid and so by its
        # training code: it must not pass as a client certificate (issue 21, item 3).
        server_as_client = _etcdctl(f"https://{endpoint}", "get", "--prefix", "/",
                                    tls=[f"--cacert={tls_dir}/ca.pem", f"--cert={tls_dir}/server.pem",
                                         f"--key={tls_dir}/server-key.pem"])
        assert server_as_client.returncode != 0 and "/elasticd/" not in server_as_client.stdout, \
            "the server certificate works as a client certificate"
        # The peer port (raft, /members) is as closed as the client port (issue 21, item 1).
        peer = _attack_peer_port(_peer_port_from_cmdline(etcd_rec["pid"]))
        reached = {what: got for what, got in peer.items() if not got.startswith("refused")}
        assert not reached, f"uid {NOBODY} reached the embedded etcd's peer handler: {reached}"

        chosen = _log_event(node.log(), "worker_log_dir_chosen")["path"]
        assert Path(chosen) != trap and not Path(chosen).is_relative_to(trap)
        st = os.stat(chosen)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert list(trap.iterdir()) == [], "worker logs went into a directory another user made"
        assert _log_event(node.log(), "agent_started")["worker_log_dir"] == chosen
        records = _etcdctl(f"https://{endpoint}", "get", "--prefix", "--print-value-only",
                           JobKeys(job).nodes_prefix, tls=owner_tls)
        assert json.loads(records.stdout.splitlines()[0])["log_dir"] == chosen  # status --json
        release.touch()
        assert node.wait(60) == 0, node.log()[-3000:]
    finally:
        node.cleanup()
        shutil.rmtree(trap, ignore_errors=True)
        for chosen_dir in trap.parent.glob(f"elasticd-logs-{job}-*"):  # the agent keeps worker logs
            shutil.rmtree(chosen_dir, ignore_errors=True)


@pytest.mark.timeout(90)
def test_local_etcd_cluster_peer_ports_refuse_another_uid(tmp_path):
    """Every member of a local N-member cluster (`elasticd etcd --members N`) refuses
    uid 65534's GET /members and POST /raft on its peer port, while the cluster serves."""
    _need_root()
    from elasticd.etcd.cluster import EmbeddedEtcdCluster

    with EmbeddedEtcdCluster(3, str(tmp_path / "cluster")) as cluster:
        client = EtcdClient(cluster.endpoints, timeout_s=3)
        try:
            client.put("/elasticd/peer-test/k", b"v")  # the members still talk raft to each other
            assert client.get("/elasticd/peer-test/k") is not None
        finally:
            client.close()
        for m in cluster.members:
            assert m.pid is not None
            peer = _attack_peer_port(_peer_port_from_cmdline(m.pid))
            reached = {what: got for what, got in peer.items() if not got.startswith("refused")}
            assert not reached, f"uid {NOBODY} reached member {m.name}'s peer handler: {reached}"


@pytest.fixture
def auth_etcd(tmp_path):
    """etcd over TLS (server certificate only) with auth on: root, and user agent-a whose
    role may only touch /elasticd/job-a/."""
    from integration.test_etcd_tls import make_pki

    pki = make_pki(tmp_path / "pki")
    server = EmbeddedEtcd(str(tmp_path / "etcd"),
                          tls=ServerTLS(pki.server_cert, pki.server_key, pki.ca,
                                        client_cert_auth=False)).start()
    url = f"https://{server.endpoint}"
    ca = [f"--cacert={pki.ca}"]
    root = ca + ["--user=root:rootpw"]
    steps = [
        (ca, ["user", "add", "root", "--new-user-password=rootpw", "--interactive=false"]),
        (ca, ["auth", "enable"]),
        (root, ["role", "add", "elasticd-job-a"]),
        (root, ["role", "grant-permission", "elasticd-job-a", "--prefix=true", "readwrite",
                "/elasticd/job-a/"]),
        (root, ["user", "add", "agent-a", "--new-user-password=pw-a", "--interactive=false"]),
        (root, ["user", "grant-role", "agent-a", "elasticd-job-a"]),
    ]
    try:
        for tls, args in steps:
            proc = _etcdctl(url, *args, tls=tls)
            assert proc.returncode == 0, f"etcdctl {' '.join(args)}: {proc.stderr}"
        (tmp_path / "pw").write_text("pw-a\n")
        (tmp_path / "wrong").write_text("not-the-password\n")
        os.chmod(tmp_path / "pw", 0o600)
        yield server, pki, tmp_path
    finally:
        server.stop(remove_data=True)


def _elasticd(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elasticd.cli", *args], capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.mark.timeout(150)
def test_agent_runs_a_job_under_a_per_job_role_over_tls(auth_etcd):
    """`elasticd run` with a user whose role covers only /elasticd/job-a/ completes a real
    one-node job; the same user cannot write another job's keys."""
    server, pki, tmp = auth_etcd
    script = tmp / "ok.py"
    script.write_text("import os; print('rank', os.environ['RANK'])\n")
    logs = tmp / "worker-logs"
    proc = _elasticd("run", "--etcd", f"https://{server.endpoint}", "--etcd-ca", pki.ca,
                     "--etcd-user", "agent-a", "--etcd-password-file", str(tmp / "pw"),
                     "--job", "job-a", "--nnodes", "1", "--node-ttl", "2", "--local-addr",
                     "127.0.0.1", "--log-format", "json", "--log-dir", str(logs), str(script))
    assert proc.returncode == 0, proc.stderr[-4000:]
    client = EtcdClient(f"https://{server.endpoint}", timeout_s=3, tls=TLSFiles(pki.ca),
                        user="agent-a", password="pw-a")
    try:
        assert client.get_prefix("/elasticd/job-a/")[0], "the job left no keys"
        with pytest.raises(ConfigError):
            client.put("/elasticd/job-b/checkpoint/latest", b"{}")
    finally:
        client.close()


@pytest.mark.timeout(90)
def test_wrong_password_and_plaintext_credentials_are_config_errors(auth_etcd):
    """A wrong password exits 78 with one line (run and status), never a traceback; a user
    and password to a plaintext endpoint are refused before connecting, unless the loudly
    named flag is given; https:// without a CA is TLS (system roots), not plaintext."""
    server, pki, tmp = auth_etcd
    https = f"https://{server.endpoint}"
    script = tmp / "ok.py"
    script.write_text("pass\n")
    wrong = ["--etcd-user", "agent-a", "--etcd-password-file", str(tmp / "wrong")]
    run = _elasticd("run", "--etcd", https, "--etcd-ca", pki.ca, *wrong, "--job", "job-a",
                    "--log-format", "json", "--log-dir", str(tmp / "wl"), str(script))
    status = _elasticd("status", "--etcd", https, "--etcd-ca", pki.ca, *wrong, "--job", "job-a")
    for proc in (run, status):
        assert proc.returncode == 78, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("elasticd")]
        errors += [json.loads(ln)["message"] for ln in proc.stderr.splitlines()
                   if ln.startswith("{") and '"agent_error"' in ln]
        assert len(errors) == 1 and "refused the credentials" in errors[0], proc.stderr[-3000:]
        assert "not-the-password" not in proc.stderr

    plain = _elasticd("run", "--etcd", server.endpoint, "--etcd-user", "agent-a",
                      "--etcd-password-file", str(tmp / "pw"), "--job", "job-a", str(script),
                      timeout_s=60)
    assert plain.returncode == 78 and "clear text" in plain.stderr, plain.stderr[-2000:]
    # The opt-in lets the client be built (the server speaks TLS, so the call then fails).
    EtcdClient(server.endpoint, user="agent-a", password="pw-a", allow_plaintext_auth=True).close()

    no_ca = EtcdClient(https, timeout_s=2)
    try:
        assert no_ca.secure
        with pytest.raises(ConfigError, match="TLS"):  # our test CA is not a system root
            no_ca.get("/elasticd/job-a/")
    finally:
        no_ca.close()


@pytest.mark.timeout(60)
def test_nospace_is_classified_and_named_by_status(tmp_path):
    """With a tiny --quota-backend-bytes, filling etcd raises EtcdNoSpaceError naming NOSPACE,
    and `elasticd status` names the NOSPACE alarm on stderr."""
    from elasticd.errors import EtcdNoSpaceError
    from elasticd.status.cli import build_parser, run

    server = EmbeddedEtcd(str(tmp_path / "etcd"), quota_backend_bytes=2 * 1024 * 1024).start()
    client = EtcdClient(server.endpoint, timeout_s=3)
    try:
        rec = NodeRecord(node="n1", host="h", pid=1, version="0", started_at=time.time())
        client.put(JobKeys("full").node("n1"), rec.to_json())
        blob = os.urandom(256 * 1024)
        with pytest.raises(EtcdNoSpaceError, match="NOSPACE") as info:
            for i in range(200):
                client.put(f"/filler/{i}", blob)
        assert "compact" in str(info.value)
        assert client.alarms() == ["NOSPACE"]
        err = io.StringIO()
        code = run(build_parser().parse_args(["status", "--etcd", server.endpoint, "--job", "full"]),
                   out=io.StringIO(), err=err)
        assert code in (0, 1, 2), err.getvalue()
        assert "etcd alarm NOSPACE" in err.getvalue()
    finally:
        client.close()
        server.stop(remove_data=True)


@pytest.mark.timeout(60)
def test_status_survives_hostile_records_without_traceback_or_escapes(etcd_server, etcd_client):
    """Node records that are JSON but not objects, or carry wrong types and terminal escape
    sequences, never crash `elasticd status` and never reach the terminal raw."""
    from elasticd.status.cli import build_parser, run

    keys = JobKeys("victim")
    evil = "\x1b]0;pwned\x07\x1b[2J\u202e"
    etcd_client.put(keys.node("list"), b"[1, 2, 3]")
    etcd_client.put(keys.node("str"), b'"just a string"')
    etcd_client.put(keys.node("types"), b'{"node": 5, "host": [], "pid": "x", "version": 1}')
    rec = NodeRecord(node=f"n{evil}", host=f"h{evil}", pid=1, version=evil, started_at=time.time(),
                     state="training", last_exit=evil)
    etcd_client.put(keys.node("esc"), rec.to_json())
    etcd_client.put(keys.progress, b'{"round": "zero", "step": []}')
    etcd_client.put(keys.event(1) + "-esc", json.dumps(
        {"time": time.time(), "kind": "failure", "node": evil, "round": 0, "message": evil,
         "detail": []}))
    for extra in ([], ["--json"], ["--max-rows", "0", "--events", "50"]):
        out, err = io.StringIO(), io.StringIO()
        code = run(build_parser().parse_args(
            ["status", "--etcd", etcd_server.endpoint, "--job", "victim", *extra]), out=out, err=err)
        text = out.getvalue() + err.getvalue()
        assert code in (0, 1, 2), text
        assert "Traceback" not in text
        for ch in ("\x1b", "\x07", "\u202e"):
            assert ch not in text, f"{ch!r} reached the terminal with {extra}"
    listing = io.StringIO()
    assert run(build_parser().parse_args(["status", "--etcd", etcd_server.endpoint]),
               out=listing, err=io.StringIO()) == 0


def _listening(port: int) -> set[str]:
    """The IPv4 addresses with a socket listening on ``port`` (from /proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            out.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_metrics_bind_loopback_by_default_and_the_configured_address(tmp_path):
    """The exporter listens on 127.0.0.1 unless configured; metrics.addr travels config ->
    NodeSpec -> the bound socket."""
    from elasticd.agent.runner import _make_metrics
    from elasticd.agent.settings import node_spec
    from elasticd.config import load_config
    from elasticd.status.metrics import AgentMetrics

    server = AgentMetrics().serve(0)
    try:
        assert _listening(server.port) == {"127.0.0.1"}
    finally:
        server.stop()
    default = load_config(None, {}, {"job.name": "m", "workers.command": "x.py"})
    assert default.metrics.addr == "127.0.0.1"
    port = _free_port()
    cfg = load_config(None, {}, {"job.name": "m", "workers.command": "x.py", "metrics.port": port,
                                 "metrics.addr": "127.0.0.2"})
    spec = node_spec(cfg, {})
    assert spec.metrics_addr == "127.0.0.2"
    _make_metrics(spec, "n0")
    assert _listening(port) == {"127.0.0.2"}


@pytest.mark.timeout(60)
def test_config_from_dev_zero_fails_fast():
    """`elasticd agent --config /dev/zero --check-config` is a config error within seconds
    (a device is not a regular file; nothing is read from it)."""
    t0 = time.monotonic()
    proc = _elasticd("agent", "--config", "/dev/zero", "--check-config", timeout_s=30)
    assert proc.returncode == 78 and "not a regular file" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(90)
def test_commit_intent_dir_is_not_squattable_in_tmp(etcd_server, tmp_path):
    """uid 65534 making `<tmp>/elasticd-<uid>` first (which blocked every agent of that uid
    outside systemd) changes nothing: the intents live under $HOME/.local/state/elasticd,
    every level elasticd made is 0700 and owned by the agent's user, and the job runs."""
    _need_root()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    squat = tmp / f"elasticd-{os.geteuid()}"
    squat.mkdir()
    os.chown(squat, NOBODY, NOBODY)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_STATE_HOME", "STATE_DIRECTORY")}
    env.update(TMPDIR=str(tmp), HOME=str(home))
    job = "squat"
    proc = subprocess.run([sys.executable, "-m", "elasticd.cli", "run", "--etcd", etcd_server.endpoint,
                           "--job", job, "--nnodes", "1", "--node-ttl", "2", "--local-addr",
                           "127.0.0.1", "--log-dir", str(tmp_path / "wl"), str(script)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(squat.iterdir()) == []
    level = home
    for part in (".local", "state", "elasticd", "commit-intents", job):
        level = level / part
        st = os.lstat(level)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid(), level
        assert stat.S_IMODE(st.st_mode) == 0o700, f"{level} is {stat.S_IMODE(st.st_mode):04o}"


@pytest.mark.timeout(60)
def test_file_checkpoints_are_unreadable_to_another_uid():
    """A file:// checkpoint under a world-readable root (umask 022): uid 65534 can neither
    list a save's directory nor read its state.pt or manifest; every level elasticd made is
    0700 and every file 0600."""
    _need_root()
    import torch

    from elasticd.checkpoint import CheckpointManager

    root = Path(tempfile.mkdtemp(prefix="elasticd-ckpt-sec-"))
    old = os.umask(0o022)
    try:
        root.chmod(0o755)  # an operator's shared checkpoint root
        mgr = CheckpointManager(f"file://{root}", job="sec", keep_last=2)
        mgr.save(1, {"model": torch.nn.Linear(4, 2)}, blocking=True)
        files = [p for p in (root / "sec").rglob("*") if p.is_file()]
        assert any(p.name == "state.pt" for p in files), files
        probe = ("import os, sys\nfor p in sys.argv[1:]:\n    try:\n"
                 "        (os.listdir if os.path.isdir(p) else (lambda q: open(q, 'rb').read(1)))(p)\n"
                 "        print('read', p)\n    except OSError:\n        pass\n")
        targets = [str(p) for p in [*files, *(p.parent for p in files)]]
        proc = subprocess.run(["/usr/bin/python3", "-c", probe, *targets], capture_output=True,
                              text=True, timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin"},
                              user=NOBODY, group=NOBODY, extra_groups=[])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "", f"uid {NOBODY} read the checkpoint:\n{proc.stdout}"
        for p in [root / "sec", *(root / "sec").rglob("*")]:
            mode = stat.S_IMODE(os.lstat(p).st_mode)
            assert mode == (0o600 if p.is_file() else 0o700), f"{p} is {mode:04o}"
    finally:
        os.umask(old)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(60)
def test_idle_connections_from_one_process_do_not_lock_workers_out_of_the_control_socket():
    """256 idle connections from one process (training code gone wrong) no longer take every
    slot of the agent's control socket: another process (a worker) still gets its ping
    answered; the hoarding process is capped."""
    from elasticd.control.server import ControlChannel

    chan = ControlChannel().start()
    hoard: list[socket.socket] = []
    try:
        served = 0
        for _ in range(256):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(chan.socket_path)
            hoard.append(s)
            try:
                s.sendall(b'{"op": "ping", "id": 1}\n')  # answered: its handler holds a slot
                served += s.recv(4096).startswith(b"{")
            except OSError:  # refused (closed by the agent)
                pass
        worker = ("import sys\nfrom elasticd.control.client import ControlClient\n"
                  "from elasticd.control.messages import Ping\n"
                  "c = ControlClient(sys.argv[1], timeout_s=5)\n"
                  "print(type(c.request(Ping())).__name__)\n")
        proc = subprocess.run([sys.executable, "-c", worker, chan.socket_path], capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 0 and "Pong" in proc.stdout, proc.stderr[-2000:]
        assert served < 256
    finally:
        for s in hoard:
            s.close()
        chan.close()


NON_DUMPABLE_TARGET = """\
import sys
if sys.argv[1] == "yes":
    from elasticd.process import make_non_dumpable
    assert make_non_dumpable()
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("non_dumpable", [False, True])
def test_a_non_dumpable_process_hides_its_environment_from_its_own_uid(non_dumpable):
    """make_non_dumpable() (what the agent calls at start): another process of the same uid
    (65534 for both: the workers' training code in the agent's uid) can no longer read its
    /proc/<pid>/environ, where the agent's etcd credentials live; without it, it can."""
    _need_root()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
           "ELASTICD_ETCD_PASSWORD": "s3cret-in-env"}
    target = subprocess.Popen(["/usr/bin/python3", "-c", NON_DUMPABLE_TARGET,
                               "yes" if non_dumpable else "no"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd="/", env=env,
                              user=NOBODY, group=NOBODY, extra_groups=[])
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "ready"
        reader = subprocess.run(["/usr/bin/python3", "-c",
                                 "import sys\ntry:\n    print(open(sys.argv[1], 'rb').read().decode(errors='replace'))\n"
                                 "except OSError as e:\n    print('refused', e.errno)",
                                 f"/proc/{target.pid}/environ"], capture_output=True, text=True,
                                timeout=30, cwd="/", env={"PATH": "/usr/bin:/bin"},
                                user=NOBODY, group=NOBODY, extra_groups=[])
        if non_dumpable:
            assert "s3cret-in-env" not in reader.stdout and "refused" in reader.stdout, reader.stdout
        else:
            assert "s3cret-in-env" in reader.stdout, reader.stdout + reader.stderr
    finally:
        if target.stdin is not None:
            target.stdin.close()
        target.wait(timeout=10)


@pytest.mark.timeout(90)
def test_the_private_etcds_peer_certificate_does_not_open_its_client_port(tmp_path):
    """A private (standalone) etcd signs its peer certificate with a CA of its own: the peer
    certificate, which every member of a cluster holds, is no etcd client certificate."""
    server = EmbeddedEtcd(str(tmp_path / "etcd"), private=True).start()
    try:
        pki, peer = server.pki, server.peer_tls
        assert pki is not None
        url = f"https://{server.endpoint}"
        ca = f"--cacert={pki.ca_file}"
        ok = _etcdctl(url, "put", "/k", "v", tls=[ca, f"--cert={pki.client_cert}",
                                                  f"--key={pki.client_key}"])
        assert ok.returncode == 0, ok.stderr
        peer_as_client = _etcdctl(url, "get", "/k", tls=[ca, f"--cert={peer.cert_file}",
                                                         f"--key={peer.key_file}"])
        assert peer_as_client.returncode != 0, "the peer certificate read the client port"
        assert "/k" not in peer_as_client.stdout
    finally:
        server.stop(remove_data=True)


@pytest.mark.timeout(90)
def test_a_forked_childs_gateway_client_keeps_the_jobs_auth(auth_etcd, monkeypatch):
    """Over etcd's HTTP gateway (a forked child's transport) the job's user reads and writes
    its own prefix over TLS, is refused another job's keys, and a wrong password is the same
    config error as over gRPC."""
    from elasticd.etcd import gateway

    server, pki, _ = auth_etcd
    monkeypatch.setattr(gateway, "_fork_child", True)
    https = f"https://{server.endpoint}"
    client = EtcdClient(https, timeout_s=3, tls=TLSFiles(pki.ca), user="agent-a", password="pw-a")
    try:
        assert all(isinstance(ep, gateway.GatewayEndpoint) for ep in client.raw().endpoints.values())
        client.put("/elasticd/job-a/gw", b"v")
        assert client.get("/elasticd/job-a/gw").value == b"v"
        with pytest.raises(ConfigError, match="denied"):
            client.put("/elasticd/job-b/checkpoint/latest", b"{}")
    finally:
        client.close()
    wrong = EtcdClient(https, timeout_s=3, tls=TLSFiles(pki.ca), user="agent-a", password="nope")
    with pytest.raises(ConfigError, match="refused the credentials"):
        wrong.get("/elasticd/job-a/gw")
    wrong.close()
