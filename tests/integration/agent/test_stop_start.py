"""`elasticd stop` then `elasticd start` with real agents, etcd and workers (issue 26 item 1).

Two nodes a and b train examples/train.py with live re-formation (the default); a is
drained, then the job is stopped and started again, b comes back first and a after it.
The stop must retire its round: b opens a new round instead of re-entering the one the
stop ended (where it trained alone in a round the arriving a then superseded: a commit
refused, a restart spent, tens of steps retrained), and `elasticd status` must never say
"training at full size" while a member's workers train in an older round.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from harness import (
    ROOT,
    agent_events,
    end_job,
    example_args,
    read_jsonl,
    trained_samples,
    wait_until,
    worker_lines,
)

from elasticd.cli import main
from elasticd.etcd.client import EtcdClient
from elasticd.keys import JobKeys
from elasticd.records import RoundState
from elasticd.status.model import EXIT_OK, derive_status
from elasticd.status.snapshot import read_job

SCRIPT = str(ROOT / "examples" / "train.py")
# A node alone (world size 1) waits after each step until its agent asks it to stop, park
# or re-form (--hold-below-world 2): b alone after the start cannot finish the job before
# a's agent is up to join it, whatever the load (with a plain 200 steps a loaded suite saw
# b finish 6 s after the start while a's agent, still importing, was refused as "job
# finished"; 480 steps only made that less likely). The job ends on the test's word
# (--end-file) once the phase a test is about is over.
STEPS = 100_000
DATASET = 480
EPOCH = 20  # steps of 24 samples
pytestmark = pytest.mark.timeout(300)


def _rounds(node_log: str) -> list[int]:
    """The rounds of a node's ``rendezvous_completed`` lines, in order."""
    return [e["round"] for e in agent_events(node_log, "rendezvous_completed")]


class StatusSampler:
    """Derives the job's status (as `elasticd status` does) every 0.1 s in a thread and
    remembers, with each answer, how many trace rows had been written when it was read."""

    def __init__(self, endpoint: str, job: str, trace: Path) -> None:
        self.client = EtcdClient(endpoint, timeout_s=2.0)
        self.job, self.trace = job, trace
        self.samples: list[tuple[int, int, str, int | None, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StatusSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            rows = len(read_jsonl(self.trace))  # rows written before the read
            try:
                snap = read_job(self.client, self.job)
            except Exception:  # noqa: BLE001 - a slow etcd under load: the next sample
                continue
            if snap is None:
                continue
            st = derive_status(snap, time.time())
            self.samples.append((rows, st.exit_code, st.state, st.round, st.reason))


def test_stop_start_retires_the_round_and_retrains_nothing(nodes, tmp_path):
    """drain a; stop; start; b back, then a: b's first round after the start is newer than
    every round before the stop, no step is trained twice, no commit is refused, each
    agent starts its worker once, every sample of every epoch is trained exactly once,
    and status never reports health while a worker still trains in an older round."""
    job, ep = "stopstart", nodes.etcd.endpoint
    trace, end = tmp_path / "trace-s.jsonl", tmp_path / "end-s"
    extra = ["--checkpoint-url", f"file://{tmp_path}/ckpt"]
    args = [*example_args(tmp_path, "s", steps=STEPS, dataset_size=DATASET), "--hold-below-world", "2",
            "--end-file", str(end)]

    def start(name: str):
        return nodes.start(job, SCRIPT, nnodes="1:2", name=name, extra=extra, script_args=args)

    a, b = start("a"), start("b")
    wait_until(lambda: {r["rank"] for r in read_jsonl(trace) if r["step"] >= 10} >= {0, 1}, 120,
               "step 10 at world 2")
    at_world_2 = len(read_jsonl(trace))  # any world-1 row after this one is b's, alone
    assert main(["drain", "--job", job, "--node", "a", "--etcd", ep, "--wait", "60"]) == 0
    assert a.wait(30) == 0, a.log()[-3000:]
    wait_until(lambda: any(r["world"] == 1 for r in read_jsonl(trace)[at_world_2:]), 60,
               "b training alone (then holding)")
    assert main(["stop", "--job", job, "--etcd", ep, "--wait", "60"]) == 0
    assert b.wait(30) == 0, b.log()[-3000:]
    rows_before = read_jsonl(trace)
    stopped_at = max(r["step"] for r in rows_before)
    round_before = max(max(_rounds(a.log())), max(_rounds(b.log())))
    assert main(["start", "--job", job, "--etcd", ep]) == 0
    # A restarted node appends to its log file: read only what the new agents wrote.
    offsets = {"b": len(b.log()), "a": len(a.log())}

    with StatusSampler(ep, job, trace) as sampler:
        b2 = start("b")
        wait_until(lambda: len(read_jsonl(trace)) > len(rows_before), 120,
                   "b training again after the start (then holding for a)")
        a2 = start("a")
        wait_until(lambda: any(r["rank"] == 1 for r in read_jsonl(trace)[len(rows_before):]), 120,
                   "a training again after the start")
        steps = end_job(end, trace, epoch_steps=EPOCH)
        assert b2.wait(240) == 0, b2.log()[-4000:]
        assert a2.wait(60) == 0, a2.log()[-4000:]
    logs = {"b2": b2.log()[offsets["b"]:], "a2": a2.log()[offsets["a"]:]}

    # (a) The stop retired its round: b's first round after the start is a new one.
    assert _rounds(logs["b2"])[0] > round_before, (
        f"b re-entered round {_rounds(logs['b2'])[0]}, which the stop ended "
        f"(rounds up to {round_before} before it)")
    rows = read_jsonl(trace)
    by_step: dict[int, set[int]] = defaultdict(set)
    for r in rows:
        by_step[r["step"]].add(r["round"] or 0)
    retrained = sorted(s for s, rounds in by_step.items() if len(rounds) > 1)
    assert not retrained, f"{len(retrained)} step(s) trained twice: {retrained[:10]}..."
    assert min(r["step"] for r in rows[len(rows_before):]) == stopped_at + 1
    for name, text in logs.items():
        assert "FencedError" not in text and "checkpoint_commit_refused" not in text, \
            f"{name}: a commit was refused\n{text[-3000:]}"
        assert "live_reform_fell_back" not in text, f"{name}: in place fell back\n{text[-3000:]}"
        started = [line for line in worker_lines(text) if '"event": "started"' in line]
        assert len(started) <= 1, f"{name}: its worker was started {len(started)} times"
    assert sorted(by_step) == list(range(steps))
    epochs = steps // EPOCH
    assert trained_samples(trace) == Counter({(e, i): 1 for e in range(epochs) for i in range(DATASET)})

    # (c) Health is the truth: after any sample that said "training at full size" in
    # round R, no worker wrote a row of an older round.
    lies = [(s, r["round"]) for s in sampler.samples if s[1] == EXIT_OK
            for r in rows[s[0]:] if (r["round"] or 0) < (s[3] or 0)]
    assert not lies, f"status said healthy while a worker trained in an older round: {lies[:3]}"
    assert any(s[1] == EXIT_OK for s in sampler.samples), "never healthy at full size"


def test_a_lone_worker_takes_an_order_for_a_newer_round_at_its_next_step(nodes, tmp_path):
    """A node training alone (world size 1) whose agent orders its worker into a newer
    round that no park preceded (a peer with a stale view opened it, as in issue 26;
    injected here as that peer's etcd write) re-forms at its next step: the same worker
    process trains on in the new round within seconds, never again in the old one, and
    nothing is retrained, refused or restarted."""
    job, trace, end = "lone", tmp_path / "trace-l.jsonl", tmp_path / "end-l"
    b = nodes.start(job, SCRIPT, nnodes="1:2", name="b",
                    extra=["--checkpoint-url", f"file://{tmp_path}/ckpt", "--live-reform-timeout", "20"],
                    script_args=[*example_args(tmp_path, "l", steps=STEPS, dataset_size=DATASET),
                                 "--end-file", str(end)])
    wait_until(lambda: len(read_jsonl(trace)) >= 8, 120, "b training alone")
    keys = JobKeys(job)
    client = EtcdClient(nodes.etcd.endpoint, timeout_s=2.0)
    try:
        kv = client.get(keys.rdzv_state)
        assert kv is not None
        old = RoundState.from_json(kv.value)
        newer = RoundState(old.round + 1, "open", list(old.members), old.min_nodes, old.max_nodes,
                           opened_at=time.time())
        assert client.put_if(keys.rdzv_state, newer.to_json(), mod_revision=kv.mod_revision)
    finally:
        client.close()
    pids = {r["pid"] for r in read_jsonl(trace)}
    wait_until(lambda: any((r["round"] or 0) > old.round for r in read_jsonl(trace)), 15,
               f"a step in a round after {old.round}")
    steps = end_job(end, trace)
    assert b.wait(120) == 0, b.log()[-3000:]
    rows = read_jsonl(trace)
    first_new = next(i for i, r in enumerate(rows) if (r["round"] or 0) > old.round)
    assert all((r["round"] or 0) > old.round for r in rows[first_new:]), \
        "the worker trained on in the superseded round after its first step in the new one"
    assert {r["pid"] for r in rows} == pids, "the worker was restarted instead of re-formed"
    assert Counter(r["step"] for r in rows) == Counter(range(steps)), "a step is missing or retrained"
    text = b.log()
    assert "live_reformed" in text
    for bad in ("FencedError", "live_reform_fell_back", "restart_backoff"):
        assert bad not in text, f"{bad} in the node's log\n{text[-3000:]}"
    # A save of the old round still committing when the round state moved is refused by
    # the commit fence, as it must be (the injected write cannot wait for it; under load
    # the step-9 save was): only saves of steps before the new round's first may be.
    refused = [json.loads(line[line.index("{"):]) for line in text.splitlines()
               if '"checkpoint_commit_refused"' in line]
    assert all(int(e.get("step", -1)) < rows[first_new]["step"] for e in refused), refused
