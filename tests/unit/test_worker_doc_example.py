"""The "after" script of docs/worker-api.md runs as printed: trains, resumes, and stops on a drain.

The script is taken from the page's before/after diff (context and ``+`` lines), so the
documentation cannot drift from the API. It runs in this process as ``python train.py``
would: world size 1, no process group, checkpoints in a temporary directory.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "worker-api.md"
STEPS_PER_EPOCH = 2048 // 64  # dataset size // GLOBAL_BATCH in the example

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "ELASTICD_JOB", "ELASTICD_NODE",
                 "ELASTICD_ROUND", "ELASTICD_CONTROL_DIR", "ELASTICD_CONTROL_SOCKET",
                 "ELASTICD_CHECKPOINT_URL")


def _diff_sides() -> tuple[str, str]:
    """(before, after) source of the first diff block under "Adapting a DDP script"."""
    text = DOC.read_text()
    section = text[text.index("## Adapting a DDP script"):]
    match = re.search(r"```diff\n(.*?)```", section, re.S)
    assert match, "docs/worker-api.md: no ```diff block under 'Adapting a DDP script'"
    before, after = [], []
    for line in match.group(1).splitlines():
        if line.startswith(("--- ", "+++ ", "@@")):
            continue
        tag, body = (line[:1], line[1:]) if line else (" ", "")
        if tag in (" ", "-"):
            before.append(body)
        if tag in (" ", "+"):
            after.append(body)
    return "\n".join(before) + "\n", "\n".join(after) + "\n"


def _load_after() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "worker_doc_example"}
    exec(compile(_diff_sides()[1], f"{DOC}#after", "exec"), namespace)  # noqa: S102
    return namespace


@pytest.fixture
def standalone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """No launcher environment, checkpoints under tmp_path; restores what init() changes."""
    from elasticd import worker

    for name in _LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    url = (tmp_path / "ckpt").as_uri()
    monkeypatch.setenv("ELASTICD_CHECKPOINT_URL", url)
    handler = signal.getsignal(signal.SIGTERM)
    yield url
    worker.shutdown()
    signal.signal(signal.SIGTERM, handler)  # init() installs a SIGTERM handler standalone


def _latest(url: str) -> Any:
    from elasticd.checkpoint.manager import CheckpointManager

    with CheckpointManager(url, job="local") as mgr:
        return mgr.load_latest()


def test_before_side_of_the_diff_is_valid_python() -> None:
    """The "before" script of the diff compiles (it needs CUDA, so it is not run)."""
    compile(_diff_sides()[0], f"{DOC}#before", "exec")


@pytest.mark.timeout(60)
def test_after_script_trains_then_resumes_at_the_next_step(standalone: str) -> None:
    """Run 1 epoch, then ask for 2: the second run loads the last step and trains only epoch 1."""
    example = _load_after()
    assert example["main"](total_epochs=1) == 0
    first = _latest(standalone)
    assert first.step == STEPS_PER_EPOCH - 1
    assert first.state["sampler"]["epoch"] == 0

    assert example["main"](total_epochs=2) == 0
    second = _latest(standalone)
    assert second.step == 2 * STEPS_PER_EPOCH - 1
    assert (second.state["sampler"]["epoch"], second.state["sampler"]["samples_trained"]) == (1, 2048)


@pytest.mark.timeout(60)
def test_after_script_drains_saves_and_exits_zero(standalone: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With the agent's drain file present it trains one step, saves it, marks stopped-0, returns 0."""
    control = tmp_path / "control"
    control.mkdir()
    (control / "drain").write_text("test")
    monkeypatch.setenv("ELASTICD_CONTROL_DIR", str(control))
    example = _load_after()

    assert example["main"](total_epochs=1) == 0
    drained = _latest(standalone)
    assert drained.step == 0
    assert drained.state["sampler"]["samples_trained"] == 64
    assert json.loads((control / "stopped-0").read_text())["step"] == 0

    (control / "drain").unlink()
    assert example["main"](total_epochs=1) == 0  # resumes at step 1, finishes the epoch
    assert _latest(standalone).step == STEPS_PER_EPOCH - 1


def _flat_loop() -> dict[str, Any]:
    """The flat-loop script of docs/worker-api.md ("A flat training loop"), loaded."""
    text = DOC.read_text()
    section = text[text.index("### A flat training loop"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/worker-api.md: no ```python block under 'A flat training loop'"
    namespace: dict[str, Any] = {"__name__": "worker_doc_flat_loop"}
    exec(compile(match.group(1), f"{DOC}#flat-loop", "exec"), namespace)  # noqa: S102
    return namespace


@pytest.mark.timeout(60)
def test_flat_loop_trains_logs_by_steps_done_and_resumes(standalone: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The flat loop as printed: 16 steps an epoch logged by loop.steps_done; its checkpoint
    step-15 holds steps 0..15; asked for 2 epochs it resumes at step 16, not at 0."""
    example = _flat_loop()
    assert example["main"](epochs=1) == 0
    first = _latest(standalone)
    assert first.step == 15 and first.state["elastic_loop"]["steps_done"] == 16
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in printed] == ["0", "10"], printed
    assert printed[0].startswith("step 0 epoch 0 world 1 loss ")

    assert example["main"](epochs=2) == 0
    assert _latest(standalone).step == 31
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1:4:2] for line in printed] == [["20", "1"], ["30", "1"]], printed
