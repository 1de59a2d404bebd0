"""End to end: every documented pipeline trains every sample of every epoch exactly once.

One multi-phase job per pipeline on real agents, live re-formation on, with the faults
combined in one schedule: two nodes train, one is SIGKILLed mid-epoch (the survivor
re-forms in place at world size 1), a new node joins mid-epoch (world size 2 again), and
the job runs to its end. The pace is the test's: the worker trains only the steps a hold
file allows (tests/workers/exactly_once.py), so every fault lands at a chosen step of a
chosen epoch, and the job ends when the test releases it, not after a step count chosen
to outlast a race.

Each rank appends a ledger row per optimizer step (the sample indices it trained, the
round it trained in); a step retrained after a fault is superseded by its final attempt
(the highest round). The audit: every sample of every epoch trained exactly once, the
same multiset as a fault-free run (plain ``python``, world size 1), and, where the global
batch is constant, the same final parameters.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from harness import PY, ROOT, agent_events, read_jsonl, wait_until

SCRIPT = str(ROOT / "tests" / "workers" / "exactly_once.py")
DATASET = 96
EPOCHS = 3
pytestmark = pytest.mark.timeout(300)

# pipeline -> (worker args, kill before step, join before step, final parameters comparable).
# batch-sampler: 6 steps per epoch at any world size; kill in epoch 0, join in epoch 1.
# distributed-drop-last: 12 steps per epoch at world size 2, 24 at 1: the kill before step
# 6 leaves epoch 0 to end at step 17, the join after step 24 deals what remains of epoch 1
# (68 samples) over 2 ranks, 34 each: a partial last batch of 2 per rank.
PIPELINES = {
    "batch-sampler": (["--pipeline", "batch-sampler", "--global-batch", "16"], 3, 8, True),
    "distributed-drop-last": (["--pipeline", "distributed-drop-last", "--batch-size", "4"], 6, 24,
                              False),
}


def _ledger(trace: Path) -> Counter:
    """(epoch, sample) -> times trained, counting each step's final attempt only."""
    rows = read_jsonl(trace)
    final: dict[int, int] = {}
    for r in rows:
        final[r["step"]] = max(final.get(r["step"], -1), r["round"] or 0)
    return Counter((r["epoch"], i) for r in rows if (r["round"] or 0) == final[r["step"]]
                   for i in r["idx"])


def _hold(path: Path, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, path)


def _waiting(trace: Path, step: int, world: int, ranks: int) -> bool:
    rows = read_jsonl(Path(str(trace) + ".wait"))
    return len({r["rank"] for r in rows if r["waiting"] == step and r["world_size"] == world}) == ranks


def _reference(tmp_path: Path, args: list[str]) -> tuple[Counter, dict]:
    trace = tmp_path / "trace-ref.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    run = subprocess.run([PY, SCRIPT, *args, "--trace", str(trace), "--live",
                          "--checkpoint-url", f"file://{tmp_path}/ckpt-ref",
                          "--final-params", str(tmp_path / "final-ref.pt")],
                         cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return _ledger(trace), torch.load(tmp_path / "final-ref.pt", weights_only=True)


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_kill_then_join_trains_every_sample_once_live(nodes, tmp_path, pipeline):
    """A live 2-node job loses a node mid-epoch (SIGKILL), gains one mid-epoch (join) and
    still trains every sample of every epoch exactly once: the ledger equals a fault-free
    run's, and with a constant global batch so do the final parameters."""
    pipe_args, kill_at, join_at, same_params = PIPELINES[pipeline]
    hold, trace = tmp_path / "hold", tmp_path / "trace-run.jsonl"
    args = [*pipe_args, "--dataset-size", str(DATASET), "--epochs", str(EPOCHS), "--live",
            "--hold", str(hold), "--trace", str(trace),
            "--checkpoint-url", f"file://{tmp_path}/ckpt-run",
            "--final-params", str(tmp_path / "final-run.pt")]
    _hold(hold, 0)
    a = nodes.start("once", SCRIPT, nnodes="1:2", name="a", script_args=args)
    b = nodes.start("once", SCRIPT, nnodes="1:2", name="b", script_args=args)
    wait_until(lambda: _waiting(trace, 0, 2, 2), 120, "both ranks at step 0 at world size 2")
    _hold(hold, kill_at)
    wait_until(lambda: _waiting(trace, kill_at, 2, 2), 60, f"both ranks at step {kill_at}")
    b.signal(signal.SIGKILL)
    _hold(hold, join_at)
    wait_until(lambda: _waiting(trace, join_at, 1, 1), 90, f"the survivor alone at step {join_at}")
    c = nodes.start("once", SCRIPT, nnodes="1:2", name="c", script_args=args)
    wait_until(lambda: agent_events(a.log(), "live_park_requested"), 90, "the join announced")
    _hold(hold, join_at + 1)  # the survivor parks at the end of the next step
    wait_until(lambda: _waiting(trace, join_at + 1, 2, 2), 90, "world size 2 after the join")
    hold.unlink()
    for node in (a, c):
        assert node.wait(120) == 0, node.log()[-4000:]

    got = _ledger(trace)
    want, want_params = _reference(tmp_path, [*pipe_args, "--dataset-size", str(DATASET),
                                              "--epochs", str(EPOCHS)])
    every = Counter((e, i) for e in range(EPOCHS) for i in range(DATASET))
    assert want == every, f"fault-free run: {sorted((want - every) + (every - want))[:10]}"
    missing, twice = every - got, got - every
    assert not missing and not twice, (f"{sum(missing.values())} samples never trained, e.g. "
                                       f"{sorted(missing)[:6]}; {sum(twice.values())} extra, e.g. "
                                       f"{sorted(twice)[:6]}")
    worlds = {r["world_size"] for r in read_jsonl(trace)}
    assert worlds == {1, 2}, worlds
    if same_params:
        got_params = torch.load(tmp_path / "final-run.pt", weights_only=True)
        for name, value in want_params.items():
            assert torch.allclose(value, got_params[name], rtol=1e-9, atol=1e-12), name
