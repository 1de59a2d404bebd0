"""A worker's process group through many live re-formations leaks nothing (issue 46).

Real agents, etcd and gloo workers: node b joins and is SIGKILLed again and again while
node a's worker re-forms in place each time. Its threads and file descriptors must stay
where the second cycle left them. ``make test`` runs 4 cycles (4 re-formations after the
baseline sample: a leak of one fd or thread per re-formation exceeds the slack); the
8-cycle run (12 after it) is under the ``soak`` marker (``make soak``). The job takes the default lifecycle: under torch 2.13
(``make test``) rebuild; under torch 2.14+ (``make compat-reconfigure``, the CI's compat
step) torch's reconfigure — the log line of the lifecycle chosen is checked against the
torch in use.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from harness import ROOT, example_args, read_jsonl, wait_until

from elasticd.worker.process_group import has_reconfigure

SCRIPT = str(ROOT / "examples" / "train.py")
SLACK = 3  # threads or fds a sample may differ by (a checkpoint or log flush in flight)


def _resources(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def _rows(trace: Path, pid: int, world: int, after_round: int) -> list[dict]:
    return [r for r in read_jsonl(trace) if r["pid"] == pid and r["world"] == world
            and (r["round"] or 0) > after_round]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cycles", [4, pytest.param(8, marks=pytest.mark.soak)])
def test_live_reformations_leave_threads_and_fds_flat(nodes, tmp_path, cycles):
    """2 x ``cycles`` live re-formations of one worker (join/SIGKILL cycles of a second
    node): the same worker process trains throughout (no fallback), and its threads and
    fds after the last cycle are within 3 of where the 2nd cycle left them."""
    trace = tmp_path / "trace-churn.jsonl"
    args = example_args(tmp_path, "churn", steps=1_000_000, dataset_size=480)
    args[args.index("--checkpoint-every") + 1] = "1000000"  # no saver thread coming and going
    ckpt = ["--checkpoint-url", f"file://{tmp_path}/ckpt-churn"]
    # The default: reconfigure where torch has it (the compat venv), rebuild otherwise.
    a = nodes.start("churn", SCRIPT, nnodes="1:2", name="a", extra=ckpt, script_args=args)
    wait_until(lambda: read_jsonl(trace), 120, "a training")
    pid = read_jsonl(trace)[0]["pid"]
    assert pid in a.tree()
    last_round, samples = -1, []
    for i in range(cycles):
        b = nodes.start("churn", SCRIPT, nnodes="1:2", name=f"b{i}", extra=ckpt, script_args=args)
        joined = wait_until(lambda after=last_round: _rows(trace, pid, 2, after), 120,
                            f"cycle {i}: a at world 2")
        last_round = joined[0]["round"]
        b.signal(signal.SIGKILL)
        b.wait(30)
        alone = wait_until(lambda after=last_round: (rows := _rows(trace, pid, 1, after))[2:] and rows,
                           120, f"cycle {i}: a alone again, 3 steps")
        last_round = alone[0]["round"]
        samples.append(_resources(pid))
        print(f"cycle {i + 1}: round {last_round}, threads {samples[-1][0]}, fds {samples[-1][1]}")
    log = a.log()
    assert "live_reform_fell_back" not in log, log[-3000:]
    assert {r["pid"] for r in read_jsonl(trace) if r["rank"] == 0 and r["world"] == 1} == {pid}
    (threads2, fds2), (threads_n, fds_n) = samples[1], samples[-1]
    assert abs(threads_n - threads2) <= SLACK and abs(fds_n - fds2) <= SLACK, samples
    chosen = [line for line in log.splitlines() if "process_group_lifecycle_chosen" in line]
    want = "reconfigure" if has_reconfigure() else "rebuild"
    assert chosen and re.search(rf"lifecycle\W+{want}", chosen[0]), chosen
    a.signal_agent(signal.SIGTERM)
    assert a.wait(90) == 0, a.log()[-3000:]
