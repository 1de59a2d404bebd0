"""Warm standby workers as real processes: hand-over, refusal, clean-up, torch's hook."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from elasticd.agent.warm import LAUNCHER, StandbyPool, env_mismatch, warm_handlers
from elasticd.process import pid_alive, wait_gone

pytestmark = pytest.mark.timeout(90)

SCRIPT = """\
import json, os, sys
sys.stderr.write("to stderr\\n")
print(json.dumps({"argv": sys.argv, "rank": os.environ.get("RANK"), "cwd": os.getcwd(),
                  "name": __name__, "path0": sys.path[0], "torch": "torch" in sys.modules}))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "ELASTICD_AGENT_PID": str(os.getpid()), "LOCAL_RANK": "0", "RANK": "0",
            "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture
def pool(tmp_path: Path):
    p = StandbyPool(True, tmp_path)
    yield p
    p.close()


def _argv(script: Path, *args: str) -> tuple[str, ...]:
    return (sys.executable, *LAUNCHER, str(script), *args)


def test_env_mismatch_ignores_only_per_round_variables():
    """Ranks, world sizes and master address may change; anything else refuses the standby."""
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "OMP_NUM_THREADS": "4"}
    assert env_mismatch(base, {**base, "RANK": "3", "WORLD_SIZE": "4", "MASTER_PORT": "9"}) == []
    assert env_mismatch(base, {**base, "OMP_NUM_THREADS": "8"}) == ["OMP_NUM_THREADS"]
    assert env_mismatch(base, {**base, "NCCL_DEBUG": "INFO"}) == ["NCCL_DEBUG"]
    launcher = {"TORCHELASTIC_RUN_ID": "j", "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": "8"}
    assert env_mismatch(base, {**base, **launcher}) == [], "set by the launcher, not read at import"


def test_handover_runs_the_script_like_worker_exec(pool, tmp_path):
    """The standby becomes the worker: argv, __main__, sys.path[0], per-round env, cwd, and
    stdout/stderr in the worker's log files; torch is already imported."""
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    pool.fill({0: _env(EXIT="3")})
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    out.write_text("")
    proc = pool.take(0, _argv(script, "--lr", "0.1"), _env(RANK="5", EXIT="3"), str(out), str(err))
    assert proc is not None and pool.handed_over == 1
    assert proc.wait(60) == 3
    got = json.loads(out.read_text())
    assert got == {"argv": [str(script), "--lr", "0.1"], "rank": "5", "cwd": os.getcwd(),
                   "name": "__main__", "path0": str(tmp_path), "torch": True}
    assert "to stderr" in err.read_text()


def test_standby_with_a_different_environment_is_not_used(pool, tmp_path):
    """A worker whose import-time environment changed starts cold; the stale standby is
    killed and reaped."""
    pool.fill({0: _env()})
    old = pool._slots[0].proc.pid
    proc = pool.take(0, _argv(tmp_path / "w.py"), _env(OMP_NUM_THREADS="7"), None, None)
    assert proc is None and pool.cold_starts == 1
    assert not pid_alive(old)


def test_other_entrypoints_start_cold(pool, tmp_path):
    """Only the agent's own launcher line is replaced (a NUMA wrapper, say, starts cold)."""
    pool.fill({0: _env()})
    assert pool.take(0, ("numactl", "--cpunodebind=0", *_argv(tmp_path / "w.py")), _env(),
                     None, None) is None


def test_dead_standby_is_replaced(pool, tmp_path):
    """A standby that died is noticed and started again by the next fill."""
    pool.fill({0: _env()})
    first = pool._slots[0].proc
    first.kill()
    first.wait(10)
    assert pool.missing(range(1)) == [0]
    pool.fill({0: _env()})
    assert pool._slots[0].proc.pid != first.pid


def test_close_leaves_no_process(tmp_path):
    """close() kills every standby by process group and reaps it."""
    p = StandbyPool(True, tmp_path)
    p.fill({0: _env(), 1: _env(LOCAL_RANK="1")})
    pids = [sb.proc.pid for sb in p._slots.values()]
    assert len(pids) == 2
    p.close()
    assert wait_gone(pids, 10) == []


def test_torch_subprocess_context_uses_the_pool(pool, tmp_path):
    """Inside warm_handlers, torch's start_processes hands workers to standbys (and the
    hook is gone afterwards)."""
    from torch.distributed.elastic.multiprocessing import (
        DefaultLogsSpecs,
        Std,
        api,
        start_processes,
    )

    original = api.get_subprocess_handler
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    pool.fill({0: _env(), 1: _env(LOCAL_RANK="1")})
    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL)
    envs = {r: {"ELASTICD_AGENT_PID": str(os.getpid()), "LOCAL_RANK": str(r), "RANK": str(10 + r),
                "PYTHONUNBUFFERED": "1"} for r in range(2)}
    with warm_handlers(pool):
        ctx = start_processes(name="w", entrypoint=sys.executable,
                              args={r: (*LAUNCHER, str(script)) for r in range(2)}, envs=envs,
                              logs_specs=logs)
    assert api.get_subprocess_handler is original
    result = ctx.wait(60)
    assert result is not None and not result.is_failed()
    assert pool.handed_over == 2
    for r in range(2):
        got = json.loads(Path(result.stdouts[r]).read_text())
        assert got["rank"] == str(10 + r) and got["torch"]


def test_past_imports_waits_for_the_first_socket_not_for_libtorch():
    """libtorch is mapped 0.1 s into a 1.3 s ``import torch``: a worker counts as past its
    imports (standbys may start beside it) only once it opened a socket, as
    ``init_process_group`` does."""
    import subprocess

    from elasticd.agent.warm import past_imports

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch; print('imported', flush=True); sys.stdin.readline();"
         "import socket; s = socket.socket(); print('socket', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "imported"
        assert not past_imports(child.pid)  # libtorch mapped, no socket yet
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "socket"
        assert past_imports(child.pid)
    finally:
        child.kill()
        child.wait(10)
    assert not past_imports(child.pid)  # gone: /proc cannot tell


AHEAD_SCRIPT = """\
import json, os, sys, time
import torch
model = torch.nn.Linear(4, 2)  # built before the round
print(json.dumps({"built": time.time(), "rank": os.environ.get("RANK")}), flush=True)
from elasticd import worker
early = worker.init()
print(json.dumps({"early_rank": early.rank, "early_world": early.world_size}), flush=True)
ctx = worker.current_context()  # a spare's worker waits here for its round
print(json.dumps({"rank": ctx.rank, "world": ctx.world_size, "env_rank": os.environ.get("RANK"),
                  "spare": os.environ.get("ELASTICD_SPARE"), "argv": sys.argv[1:],
                  "admitted": time.time()}))
"""


def _ahead_env(**extra: str) -> dict[str, str]:
    env = _env(**extra)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ELASTICD_CONTROL_SOCKET"):
        env.pop(name, None)
    return env


def _wait_for(path: Path, text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} within {timeout_s}s: {content[-2000:]!r}")


def test_a_spare_runs_its_script_ahead_and_joins_its_round_at_the_hand_over(pool, tmp_path):
    """workers.spare_prebuild: the first line starts the script with no round (its model
    is built, init() returns a context of rank -1 and world 0, and the first call that needs
    the round waits); the second line, at the admission, gives it the round's environment
    and the worker's log files, and the script goes on in the same process."""
    script = tmp_path / "w.py"
    script.write_text(AHEAD_SCRIPT)
    pool.fill({0: _ahead_env()})
    pid = pool._slots[0].proc.pid
    assert pool.run_ahead(0, _argv(script, "--lr", "0.1"), _ahead_env())
    standby_log = tmp_path / "standby-0.log"
    early = _wait_for(standby_log, '"early_world": 0', 90)  # built, and waiting for its round
    lines = [json.loads(line) for line in early.splitlines() if line.startswith("{")]
    assert lines[0]["rank"] is None and lines[1] == {"early_rank": -1, "early_world": 0}
    _wait_for(standby_log, "spare_worker_waiting", 30)
    assert pool._slots[0].proc.poll() is None, "it waits, it does not train"
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    handed = time.time()
    proc = pool.take(0, _argv(script, "--lr", "0.1"), _env(RANK="0", WORLD_SIZE="1"), str(out), str(err))
    assert proc is not None and proc.pid == pid and pool.handed_over == 1
    assert proc.wait(60) == 0
    got = json.loads(out.read_text().strip().splitlines()[-1])
    assert got["rank"] == 0 and got["world"] == 1 and got["env_rank"] == "0"
    assert got["spare"] is None and got["argv"] == ["--lr", "0.1"]
    assert lines[0]["built"] < handed <= got["admitted"]
    assert "spare_worker_admitted" in err.read_text()


def test_a_spare_handed_other_arguments_starts_cold(pool, tmp_path):
    """The worker at the admission must be the one that ran ahead: other arguments (a new
    command line) discard it and start cold."""
    script = tmp_path / "w.py"
    script.write_text(AHEAD_SCRIPT)
    pool.fill({0: _ahead_env()})
    old = pool._slots[0].proc.pid
    assert pool.run_ahead(0, _argv(script, "--lr", "0.1"), _ahead_env())
    assert pool.take(0, _argv(script, "--lr", "0.2"), _env(RANK="0"), None, None) is None
    assert pool.cold_starts == 1 and wait_gone([old], 10) == []


def test_a_spare_whose_script_dies_ahead_turns_running_ahead_off(pool, tmp_path):
    """A script that cannot run ahead (here it reads RANK before init()) dies before its
    admission: the agent says so once, naming the log, and its spares start cold from then
    on (a crash per spare wait would only repeat)."""
    script = tmp_path / "w.py"
    script.write_text("import os\nprint(os.environ['RANK'])\n")
    pool.fill({0: _ahead_env()})
    proc = pool._slots[0].proc
    assert pool.run_ahead(0, _argv(script), _ahead_env())
    assert proc.wait(60) != 0
    assert pool.missing(range(1)) == [0]
    assert "standby-0.log" in pool.ahead_failed
    assert "KeyError" in (tmp_path / "standby-0.log").read_text()
    pool.fill({0: _ahead_env()})
    assert not pool.run_ahead(0, _argv(script), _ahead_env())
