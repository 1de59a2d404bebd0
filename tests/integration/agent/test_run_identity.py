"""Run identity end to end: real agents, real embedded etcd, examples/train.py, local files.

Two runs that share a checkpoint URL and a job name must not resume from each other by
accident (issue 11 section 3): a second ``--standalone`` run (a fresh etcd, so a new run
id) refuses with exit 78, ``--resume require`` takes over on purpose, and a run still
known in etcd resumes its own checkpoints without any flag.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess

import pytest
from harness import PY, ROOT, Node, end_job, wait_until

from elasticd.checkpoint.catalog import list_checkpoints
from elasticd.errors import EX_CONFIG

SCRIPT = str(ROOT / "examples" / "train.py")
OPEN_ENDED = 100_000  # --steps of a run that ends on the test's word (--end-file) or Ctrl-C
ARGS = ["--dataset-size", "64", "--global-batch", "8", "--micro-batch", "8",
        "--checkpoint-every", "3"]


def _standalone(tmp_path, url: str, tag: str, steps: int, extra: list[str] | None = None,
                state: str = "state") -> Node:
    argv = [PY, "-m", "elasticd.cli", "run", "--standalone", "--job", "shared",
            "--nproc-per-node", "1", "--log-format", "json", "--no-warm-start",
            "--checkpoint-url", url, *(extra or []), SCRIPT, "--steps", str(steps), *ARGS]
    # Each test its own state dir: the standalone run records live there.
    return Node(argv, {"STATE_DIRECTORY": str(tmp_path / state)}, tmp_path / f"{tag}.log")


def _exit_code(node: Node, timeout_s: float) -> int:
    """The node's exit code; on a timeout, fail with its log (generous bounds: a loaded box)."""
    try:
        return node.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no exit within {timeout_s:.0f}s:\n{node.log()[-3000:]}") from None


def _resumed_from(node: Node) -> list:
    out = []
    for line in node.log().splitlines():
        try:
            row = json.loads(line[line.index("{"):])
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("event") == "started":
            out.append(row.get("resumed_from"))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_second_standalone_run_refuses_then_resumes_on_request(tmp_path):
    """Run 1 saves; run 2 (new run id, no record of run 1: another machine's state dir) exits
    78 naming run 1 and its step; --resume require resumes."""
    url = f"file://{tmp_path}/ckpt"
    started: list[Node] = []
    try:
        first = _standalone(tmp_path, url, "first", steps=6)
        started.append(first)
        assert _exit_code(first, 180) == 0, first.log()[-3000:]
        saved = list_checkpoints(url, "shared")
        run1 = saved[0].run_id
        assert len(run1) == 16 and saved[0].step == 5

        second = _standalone(tmp_path, url, "second", steps=9, state="other-state")
        started.append(second)
        assert _exit_code(second, 150) == EX_CONFIG, second.log()[-3000:]
        log = second.log()
        assert run1 in log and "newest step 5" in log and "--resume require" in log
        assert {i.step for i in list_checkpoints(url, "shared")} == {i.step for i in saved}

        third = _standalone(tmp_path, url, "third", steps=9, extra=["--resume", "require"],
                            state="other-state")
        started.append(third)
        assert _exit_code(third, 180) == 0, third.log()[-3000:]
        assert _resumed_from(third) == [5]
        after = list_checkpoints(url, "shared")
        assert after[0].step == 8 and after[0].run_id not in ("", run1)
        assert any(i.run_id == run1 for i in after), "run 1's saves were pruned by run 3"
    finally:
        for node in started:
            node.cleanup()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_run_known_in_etcd_resumes_its_own_checkpoints(nodes, tmp_path):
    """Same etcd, same job: an agent killed and restarted keeps the run id and resumes."""
    url = f"file://{tmp_path}/ckpt"
    extra = ["--checkpoint-url", url, "--no-warm-start"]
    end = tmp_path / "end"  # the kill lands while the job trains: it ends on the test's word
    args = ["--steps", str(OPEN_ENDED), "--step-sleep", "0.1", "--end-file", str(end), *ARGS]
    first = nodes.start("known", SCRIPT, nnodes="1", extra=extra, script_args=args)
    wait_until(lambda: any(i.valid for i in list_checkpoints(url, "known")), 180,
               "a first checkpoint")
    first.signal(signal.SIGKILL)
    first.wait(60)
    end_job(end, max(i.step for i in list_checkpoints(url, "known")))
    again = nodes.start("known", SCRIPT, nnodes="1", extra=extra, script_args=args)
    assert _exit_code(again, 210) == 0, again.log()[-3000:]
    resumed = _resumed_from(again)
    assert resumed and resumed[0] is not None and resumed[0] >= 2, resumed
    assert len({i.run_id for i in list_checkpoints(url, "known")}) == 1


def _readme_run(tmp_path, tag: str) -> Node:
    """The README's own command (no --job, no --checkpoint-url) in directory tmp_path; it
    trains until Ctrl-C or until the test writes the step count to ``tmp_path/end``."""
    # The first run must still train while `elasticd status` starts and answers (with 30
    # steps a loaded machine saw the job finish first: "not training"): no step count is
    # long enough for every load, so the test says when the job ends.
    argv = [PY, "-m", "elasticd.cli", "run", "--standalone", "--nproc-per-node", "1",
            "--log-format", "json", "--no-warm-start", "--workdir", str(tmp_path), SCRIPT,
            "--steps", str(OPEN_ENDED), "--step-sleep", "0.05",
            "--end-file", str(tmp_path / "end"), *ARGS]
    return Node(argv, {"STATE_DIRECTORY": str(tmp_path / "state")}, tmp_path / f"{tag}.log")


def _events(node: Node, event: str) -> list[dict]:
    out = []
    for line in node.log().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("event") == event:
            out.append(row)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rerunning_the_readme_command_continues_after_ctrl_c_and_starts_anew_once_finished(
        tmp_path):
    """Same command, same directory: after Ctrl-C it continues the run (said in one line);
    once finished it trains again as a new run, leaving the finished run's saves untouched."""
    url = f"file://{tmp_path}/checkpoints"
    started: list[Node] = []
    try:
        first = _readme_run(tmp_path, "first")
        started.append(first)
        wait_until(lambda: any(i.valid and i.step >= 2 for i in list_checkpoints(url)), 180,
                   lambda: f"a first checkpoint under {url}:\n{first.log()[-2000:]}")
        # The printed `elasticd status ...` line works as pasted, while the job runs.
        printed = _events(first, "status_command_printed")
        assert len(printed) == 1, first.log()[-3000:]
        argv = shlex.split(printed[0]["command"])
        assert argv[:2] == ["elasticd", "status"] and "--etcd-ca" in argv
        shown = subprocess.run([PY, "-m", "elasticd.cli", *argv[1:]], capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode in (0, 1), shown.stderr  # training (full size or degraded)
        assert "TRAINING" in shown.stdout, shown.stdout
        first.signal_agent(signal.SIGINT)  # Ctrl-C reaches the agent
        assert _exit_code(first, 120) == 0, first.log()[-3000:]
        run1 = {i.run_id for i in list_checkpoints(url)}
        assert len(run1) == 1
        # The rerun continues from the Ctrl-C's save and finishes a few steps later.
        steps = end_job(tmp_path / "end", max(i.step for i in list_checkpoints(url)))

        second = _readme_run(tmp_path, "second")
        started.append(second)
        assert _exit_code(second, 180) == 0, second.log()[-3000:]
        said = _events(second, "standalone_run_continued")
        assert len(said) == 1 and "continuing run" in said[0]["message"], second.log()[-3000:]
        resumed = _resumed_from(second)
        assert resumed and resumed[0] is not None and resumed[0] >= 2, resumed
        saves = list_checkpoints(url)
        assert saves[0].step == steps - 1 and {i.run_id for i in saves} == run1
        # The first day's log: round chatter at debug, nodes named nnodes, a closing line.
        assert not _events(second, "rendezvous_step")
        assert [e["action"] for e in _events(second, "coordinator_step")] == ["finalize"]
        formed = _events(second, "rendezvous_completed")
        assert formed and formed[0]["nnodes"] == 1 and "world_size" not in formed[0]
        files = _events(second, "run_files")
        assert len(files) == 1 and files[0]["checkpoint_url"] == url
        rows = [json.loads(line) for line in second.log().splitlines() if line.startswith("{")]
        assert rows[-1]["event"] == "run_files", rows[-1]  # the last line, after the teardown
        assert f"checkpoints in {url}; worker logs in {tmp_path / 'state'}" in files[0]["message"]

        third = _readme_run(tmp_path, "third")
        started.append(third)
        assert _exit_code(third, 180) == 0, third.log()[-3000:]
        said = _events(third, "standalone_run_started_anew")
        assert len(said) == 1 and "finished before" in said[0]["message"], third.log()[-3000:]
        assert _resumed_from(third) == [None], "a new run after a finished one starts afresh"
        after = list_checkpoints(url)
        assert len({i.run_id for i in after}) == 2, "the new run saved under its own run id"
        old = [(i.step, i.save_id) for i in after if i.run_id in run1]
        assert old == [(i.step, i.save_id) for i in saves], "the finished run's saves changed"
    finally:
        for node in started:
            node.cleanup()


TUTORIAL = str(ROOT / "examples" / "ddp_tutorial_elastic.py")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_seed_tutorial_run_twice_in_one_directory_trains_twice(tmp_path):
    """The DDP tutorial's command (2 workers, standalone) run again after it finished trains
    every epoch again as a new run id, and the first run's checkpoints stay as they were."""
    url = f"file://{tmp_path}/checkpoints"
    argv = [PY, "-m", "elasticd.cli", "run", "--standalone", "--nproc-per-node", "2",
            "--log-format", "json", "--no-warm-start", "--workdir", str(tmp_path), TUTORIAL,
            "2", "1", "--batch_size", "8", "--dataset_size", "64"]
    started: list[Node] = []
    try:
        runs = []
        for tag in ("first", "second"):
            node = Node(argv, {"STATE_DIRECTORY": str(tmp_path / "state")}, tmp_path / f"{tag}.log")
            started.append(node)
            assert _exit_code(node, 240) == 0, node.log()[-3000:]
            epochs = [line for line in node.log().splitlines() if "| Batchsize: 8" in line]
            assert len(epochs) == 2 * 2, f"{tag}: 2 epochs x 2 ranks:\n{node.log()[-3000:]}"
            runs.append([(i.run_id, i.step, i.save_id) for i in list_checkpoints(url)])
        assert runs[0] and len({r for r, _, _ in runs[0]}) == 1, runs
        new = [s for s in runs[1] if s not in runs[0]]
        assert new and {r for r, _, _ in new}.isdisjoint({r for r, _, _ in runs[0]}), runs
        assert set(runs[0]) <= set(runs[1]), "the finished run's checkpoints were touched"
        said = _events(started[1], "standalone_run_started_anew")
        assert len(said) == 1 and "starting new run" in said[0]["message"], said
    finally:
        for node in started:
            node.cleanup()
