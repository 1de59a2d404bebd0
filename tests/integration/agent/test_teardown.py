"""How a worker group ends (issue 11): a finished script is never re-run and never hangs
the job, a plain script's node leaves at once on SIGTERM, and a worker's configuration
error (exit 78) is not retried. Real etcd, real agents and workers, real signals."""

from __future__ import annotations

import signal
import time

import pytest
from harness import ROOT, read_jsonl, wait_until

from elasticd.keys import JobKeys

PLAIN = str(ROOT / "tests" / "workers" / "plain_ddp.py")
CONFIG_ERROR = str(ROOT / "tests" / "workers" / "config_error.py")


def _plain_env(tmp_path, tag: str, **extra: str) -> dict[str, str]:
    return {"SNAPSHOT": str(tmp_path / f"snap-{tag}.pt"), "OUT": str(tmp_path / f"epochs-{tag}.jsonl"),
            **extra}


def _epochs(tmp_path, tag: str) -> list[int]:
    return [r["epoch"] for r in read_jsonl(tmp_path / f"epochs-{tag}.jsonl")]


@pytest.mark.timeout(90)
def test_abort_in_teardown_after_the_script_finished_is_success(nodes, tmp_path):
    """Regression: a worker that completed its script and then died with SIGABRT in
    teardown (torch's gloo destructor race) finished the job: exit 0, no restart, each
    epoch trained once, one log line saying the abort was ignored."""
    env = _plain_env(tmp_path, "abort", EPOCHS="2", AT_EXIT="abort")
    node = nodes.start("abort", PLAIN, env=env, nnodes="1", nproc=2,
                       extra=["--max-restarts", "1", "--restart-backoff", "0.1"])
    assert node.wait(75) == 0, node.log()[-3000:]
    assert _epochs(tmp_path, "abort") == [0, 1]
    log = node.log()
    assert log.count("teardown after that ignored") >= 1 and "restart_backoff" not in log, log[-3000:]


@pytest.mark.timeout(90)
def test_hang_in_teardown_after_the_script_finished_ends_after_the_bound(nodes, tmp_path):
    """Regression: a worker that completed its script but never exits (a teardown hang) is
    stopped after --done-exit and the job counts as finished, instead of hanging forever."""
    env = _plain_env(tmp_path, "hang", EPOCHS="2", AT_EXIT="hang")
    node = nodes.start("hang", PLAIN, env=env, nnodes="1", nproc=2, extra=["--done-exit", "2"])
    assert node.wait(75) == 0, node.log()[-3000:]
    assert _epochs(tmp_path, "hang") == [0, 1]
    assert "completed their script but did not exit" in node.log()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_seed_style_script_finishes_every_time(nodes, tmp_path, warm):
    """The seed-style plain DDP script with 2 workers (with and without warm standbys) exits
    0 in bounded time and trains each epoch once. (benchmarks/teardown_soak.py runs the same
    30 times each way: the teardown races it pinned showed in a few runs of 30, so a second
    run here bought little.)"""
    extra = [] if warm else ["--no-warm-start"]
    tag = "warm" if warm else "cold"
    node = nodes.start(f"soak-{tag}", PLAIN, env=_plain_env(tmp_path, tag, EPOCHS="2"),
                       nnodes="1", nproc=2, extra=extra)
    assert node.wait(40) == 0, node.log()[-3000:]
    assert _epochs(tmp_path, tag) == [0, 1], node.log()[-3000:]


@pytest.mark.timeout(120)
def test_plain_script_node_leaves_within_5s_of_sigterm(nodes, tmp_path, etcd_client):
    """Regression: SIGTERM to a node whose workers never call should_stop (a plain script)
    stops them at once instead of after the 60 s drain grace: the agent exits 0 and its
    lease is revoked within 5 s, and the peer re-forms without it (no budget spent)."""
    env = _plain_env(tmp_path, "stop", EPOCHS="100000")
    a = nodes.start("stop", PLAIN, env=env, nnodes="1:2", nproc=1, name="a")
    b = nodes.start("stop", PLAIN, env=env, nnodes="1:2", nproc=1, name="b")
    out = tmp_path / "epochs-stop.jsonl"
    wait_until(lambda: any(r["world"] == 2 for r in read_jsonl(out)), 60, "training at world 2")
    node_key = JobKeys("stop").node("a")
    assert etcd_client.get(node_key) is not None
    t0 = time.monotonic()
    a.signal_agent(signal.SIGTERM)
    assert a.wait(10) == 0, a.log()[-3000:]
    gone = wait_until(lambda: etcd_client.get(node_key) is None and time.monotonic(), 10, "a's lease revoked")
    print(f"plain-script node left {gone - t0:.2f}s after SIGTERM")
    assert gone - t0 < 5.0, f"node left {gone - t0:.1f}s after SIGTERM\n{a.log()[-3000:]}"
    assert "workers_stopped_now" in a.log()
    rows_before = len(read_jsonl(out))
    wait_until(lambda: any(r["world"] == 1 for r in read_jsonl(out)[rows_before:]), 60,
               "b training alone")
    assert "restart_backoff" not in b.log(), "the peer spent restart budget on a clean leave"


@pytest.mark.timeout(90)
def test_config_error_in_a_worker_exits_78_without_retry(nodes, tmp_path):
    """Regression: a worker's ConfigError (global batch smaller than the world size) exits
    78; the agent does not retry it and exits 78 with one summary naming the error and the
    world sizes that work (it used to flap through every restart)."""
    node = nodes.start("cfg", CONFIG_ERROR, env={"GLOBAL_BATCH": "1"}, nnodes="1", nproc=2,
                       extra=["--max-restarts", "3", "--restart-backoff", "0.1"])
    assert node.wait(60) == 78, node.log()[-3000:]
    log = node.log()
    assert log.count("elasticd: giving up") == 1, log[-3000:]
    assert "smaller than the world size 2" in log and "World sizes that work" in log, log[-3000:]
    assert "restart_backoff" not in log, log[-3000:]
