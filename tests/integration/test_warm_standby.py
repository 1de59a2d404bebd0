"""Warm standby workers as real processes: hand-over, refusal, clean-up, torch's hook."""

from __future__ import annotations

import json
import os
import sys
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
