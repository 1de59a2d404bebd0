"""``--workers-user``: a real root agent runs its real worker as uid 65534 (issue 21 item 3).

The worker trains, its ``/proc/<pid>/status`` says uid 65534, it can read neither the
embedded etcd's key file (named on etcd's world-readable command line) nor the agent's
``/proc`` environment, it can write its own torch error file, and a drain loses no step.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import sys
import tempfile
from pathlib import Path

import pytest
from harness import PY, ROOT, Node, read_jsonl, wait_until

NOBODY = 65534

# Run as the worker (before examples/train.py): what this process is and may read.
PROBE = """\
import json, os, runpy, sys
out, train = sys.argv[1], sys.argv[2]

def attempt(path):
    try:
        with open(path, "rb") as fh:
            fh.read(1)
        return "read"
    except OSError as exc:
        return type(exc).__name__

keys = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\\0")
    except OSError:
        continue
    for i, a in enumerate(argv):
        if a in ("--key-file", "--peer-key-file") and i + 1 < len(argv):
            keys.append(argv[i + 1])
        elif a.startswith(("--key-file=", "--peer-key-file=")):
            keys.append(a.split("=", 1)[1])
err = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
res = {"uid": os.getuid(), "gid": os.getgid(), "pid": os.getpid(), "home": os.environ.get("HOME"),
       "user": os.environ.get("USER"), "safe_path": os.environ.get("PYTHONSAFEPATH"),
       "agent_environ": attempt(f"/proc/{os.environ['ELASTICD_AGENT_PID']}/environ"),
       "keys": {k: attempt(k) for k in keys},
       "error_dir_writable": bool(err) and os.access(os.path.dirname(err), os.W_OK)}
with open(os.path.join(out, f"probe-{os.environ['RANK']}.json"), "w") as fh:
    json.dump(res, fh)
sys.argv = [train, *sys.argv[3:]]
runpy.run_path(train, run_name="__main__")
"""

# A private mount namespace for the agent where the interpreter is reachable by uid 65534
# when it lives under a 0700 /root (as on the team's machine): a tmpfs over /root that holds
# only the interpreter's tree. Nothing outside the agent's namespace changes.
NAMESPACE = """\
set -e
mount --bind /root/.pyenv "$PYENV_MNT"
mount -t tmpfs -o mode=0755 elasticd-test /root
mkdir /root/.pyenv
mount --bind "$PYENV_MNT" /root/.pyenv
exec "$@"
"""


def _searchable_by_nobody(path: str) -> bool:
    p = Path(path).resolve()
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in [p, *p.parents])


def _launcher() -> list[str]:
    """How to start the agent so that uid 65534 can run its interpreter (or skip, saying why)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the agent must be root to run workers as another uid")
    try:
        pwd.getpwuid(NOBODY)
    except KeyError:
        pytest.skip("no user with uid 65534 (nobody) on this machine")
    if sys.version_info < (3, 11):
        pytest.skip("workers.user needs Python 3.11 (PYTHONSAFEPATH)")
    if _searchable_by_nobody(sys.base_prefix) and _searchable_by_nobody(sys.prefix):
        return []
    if not sys.base_prefix.startswith("/root/.pyenv/") or not shutil.which("unshare"):
        pytest.skip(f"the interpreter ({sys.base_prefix}) is not reachable by uid 65534 and "
                    "no mount namespace can make it so here")
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", NAMESPACE, "sh"]


def _probe(out: Path) -> dict:
    try:
        return json.loads((out / "probe-0.json").read_text())
    except (OSError, ValueError):
        return {}


def _assert_uid(pid: int) -> None:
    status = Path(f"/proc/{pid}/status").read_text()
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == [str(NOBODY)] * 4, uid_line



def _remove_agent_log_dirs(job: str) -> None:
    """The agent keeps its workers' logs in a private ``elasticd-logs-<job>-*`` dir of the
    system temp dir (root-owned workers' logs, so not under a tmp_path): remove this job's."""
    for path in Path(tempfile.gettempdir()).glob(f"elasticd-logs-{job}-*"):
        shutil.rmtree(path, ignore_errors=True)

@pytest.mark.timeout(150)
@pytest.mark.parametrize("restart", [
    "none",
    # 35 s vs 32 s for "none" at load 16 on the team machine (15 s at load 11).
    pytest.param("warm", marks=pytest.mark.slow),
])
def test_workers_run_as_their_own_uid_and_a_drain_loses_no_step(restart):
    """The worker is uid 65534 and holds no way into the control plane; with ``warm``, a
    SIGKILL restarts it through a warm standby (root until the hand-over), switched the
    same way; SIGTERM drains losing no step."""
    launcher = _launcher()
    shared = Path(tempfile.mkdtemp(prefix="elasticd-wu-"))
    try:
        shared.chmod(0o755)
        out, ckpt = shared / "out", shared / "ckpt"
        for d in (out, ckpt):
            d.mkdir(mode=0o700)
            os.chown(d, NOBODY, NOBODY)
        (shared / "pyenv").mkdir()
        probe = shared / "probe_train.py"
        probe.write_text(PROBE)
        probe.chmod(0o644)
        trace = out / "trace.jsonl"
        job = f"wu-{os.getpid()}"
        argv = [*launcher, PY, "-m", "elasticd.cli", "run", "--standalone", "--job", job,
                "--workers-user", pwd.getpwuid(NOBODY).pw_name, "--checkpoint-url",
                f"file://{ckpt}", "--log-format", "json", "--max-restarts", "2",
                *(["--no-warm-start"] if restart == "none" else []),
                str(probe), str(out), str(ROOT / "examples" / "train.py"), "--steps", "100000",  # ends on SIGTERM
                "--dataset-size", "96", "--global-batch", "8", "--micro-batch", "8",
                "--checkpoint-every", "5", "--step-sleep", "0.03", "--trace", str(trace)]
        node = Node(argv, {"PYENV_MNT": str(shared / "pyenv")}, shared / "agent.log")
        try:
            wait_until(lambda: len(read_jsonl(trace)) >= 12 or not node.alive(), 90,
                       lambda: f"12 steps as uid 65534:\n{node.log()[-3000:]}")
            assert node.alive(), node.log()[-3000:]
            first = _probe(out)
            _assert_uid(first["pid"])
            if restart == "warm":  # the same switch in the same launcher, from a standby
                wait_until(lambda: '"standby_started"' in node.log(), 60, "a standby")
                os.kill(first["pid"], signal.SIGKILL)
                wait_until(lambda: (_probe(out) or first)["pid"] != first["pid"] or not node.alive(),
                           90, lambda: f"the restarted worker:\n{node.log()[-3000:]}")
            res = _probe(out)
            _assert_uid(res["pid"])
            if restart == "warm":
                assert '"standby_handed_over"' in node.log(), node.log()[-3000:]
                done = len(read_jsonl(trace))
                wait_until(lambda: len(read_jsonl(trace)) >= done + 5 or not node.alive(), 60,
                           "steps after the restart")
            assert res["uid"] == NOBODY and res["gid"] == pwd.getpwuid(NOBODY).pw_gid, res
            assert res["home"] == pwd.getpwuid(NOBODY).pw_dir and res["user"], res
            assert res["safe_path"] is None, "PYTHONSAFEPATH leaked into the training code"
            assert res["agent_environ"] == "PermissionError", res
            assert res["keys"], f"no etcd key file on any command line: {res}"
            assert set(res["keys"].values()) == {"PermissionError"}, res
            assert res["error_dir_writable"], res
            node.signal_agent(signal.SIGTERM)
            assert node.wait(60) == 0, node.log()[-4000:]
        finally:
            node.cleanup()
        trained = max(r["step"] for r in read_jsonl(trace))
        steps = sorted(int(p.name.split("-")[-1]) for p in (ckpt / job).iterdir()
                       if p.name.split("-")[-1].isdigit())
        assert steps and steps[-1] >= trained, (
            f"drained after step {trained} but the newest checkpoint is {steps}:\n{node.log()[-3000:]}")
        owners = {p.stat().st_uid for p in (ckpt / job).rglob("*")}
        assert owners == {NOBODY}, f"checkpoint files owned by {owners}"
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        _remove_agent_log_dirs(f"wu-{os.getpid()}")


@pytest.mark.timeout(60)
def test_the_worker_writes_its_torch_error_file_under_a_root_private_log_dir():
    """The launcher, started as root with ``ELASTICD_RUN_AS``, switches to uid 65534 and
    still records its uncaught exception in torch's error file, whose levels above the
    rank directory stay root's 0700."""
    import subprocess

    launcher = _launcher()
    shared = Path(tempfile.mkdtemp(prefix="elasticd-wu-"))
    try:
        shared.chmod(0o755)
        (shared / "pyenv").mkdir()
        rank_dir = shared / "logs" / "attempt_0" / "0"
        rank_dir.mkdir(parents=True)
        (shared / "logs").chmod(0o700)
        script = shared / "fail.py"
        script.write_text('import os\nassert os.getuid() == 65534\nraise RuntimeError("boom")\n')
        script.chmod(0o644)
        env = {**os.environ, "PYENV_MNT": str(shared / "pyenv"), "PYTHONSAFEPATH": "1",
               "ELASTICD_RUN_AS": f"{pwd.getpwuid(NOBODY).pw_name}:{NOBODY}:{pwd.getpwuid(NOBODY).pw_gid}",
               "TORCHELASTIC_ERROR_FILE": str(rank_dir / "error.json")}
        proc = subprocess.run([*launcher, PY, "-m", "elasticd.agent.worker_exec", str(script)],
                              env=env, capture_output=True, text=True, timeout=50, cwd="/")
        assert proc.returncode == 1, proc.stderr[-3000:]
        data = json.loads((rank_dir / "error.json").read_text())
        assert data["message"]["message"] == "RuntimeError: boom", data
        assert (rank_dir / "error.json").stat().st_uid == NOBODY
        assert stat.S_IMODE((shared / "logs").stat().st_mode) == 0o700
    finally:
        shutil.rmtree(shared, ignore_errors=True)
