"""End to end: every documented pipeline trains every sample of every epoch exactly once.

Multi-phase jobs per pipeline, path (live re-formation or the restart path) and model
(DDP, FSDP2, HSDP) on real agents, with the faults combined in two schedules. Kill/join/drain:
two nodes train, one is SIGKILLed mid-epoch (world size 1), a new node joins mid-epoch
(world size 2 again), then that node is drained mid-epoch (SIGTERM to its agent), and the
survivor runs the job to its end. HSDP runs 2 workers per node (a 2 x 2 mesh, replicate x
shard, 1 x 2 while one node is out): the world sizes double, the schedule is the same. Freeze/stop/start: one node's whole process tree is
SIGSTOPped mid-epoch (the other trains alone once its lease expires), SIGCONTed (it
rejoins), the job is stopped mid-epoch (``elasticd stop``) and started again
(``elasticd start``, both agents restarted). Two more jobs pin issue 45's guards: a
worker crash before any checkpoint keeps the survivors' steps, and a module kept from
before a live re-formation is refused with exit 78 naming ``loop.model``.
The pace is the test's: the worker trains only the steps a hold file allows
(tests/workers/exactly_once.py), so every fault lands at a chosen step of a chosen epoch,
and the job ends when the test releases it, not after a step count chosen to outlast a
race.

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
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness import PY, ROOT, read_jsonl, wait_until

from elasticd.cli import main

SCRIPT = str(ROOT / "tests" / "workers" / "exactly_once.py")
DATASET = 96
EPOCHS = 3
pytestmark = pytest.mark.timeout(420)

SOAK = os.environ.get("ELASTICD_SOAK") == "1"

# pipeline -> (worker args, first fault before step, second, third, final parameters
# comparable). batch-sampler, stateful-loader and stream: 6 steps per epoch at any world
# size; the first fault falls in epoch 0, the second in epoch 1, the third in epoch 2.
# distributed*: 12 steps per epoch at world size 2, 24 at 1: a node lost before step 6
# leaves epoch 0 to end at step 17; a node back after step 24 deals what remains of epoch 1
# (68 samples) over 2 ranks, 34 each (a partial last batch of 2 per rank), so epoch 1 ends
# at step 33; the third fault falls 4 steps into epoch 2.
PIPELINES = {
    "batch-sampler": (["--pipeline", "batch-sampler", "--global-batch", "16"], 3, 8, 14, True),
    "distributed": (["--pipeline", "distributed", "--batch-size", "4"], 6, 24, 38, False),
    "distributed-drop-last": (["--pipeline", "distributed-drop-last", "--batch-size", "4"], 6, 24,
                              38, False),
    "stateful-loader": (["--pipeline", "stateful-loader", "--global-batch", "16"], 3, 8, 14, True),
    "stream": (["--pipeline", "stream", "--global-batch", "16"], 3, 8, 14, True),
}
# model -> (worker args, processes per node). FSDP2 and HSDP (sharded=) train an MLP; HSDP's
# mesh is (replicate = nodes, shard = processes per node), so it runs 2 workers per node.
MODELS = {"ddp": ([], 1), "fsdp": (["--fsdp"], 1), "hsdp": (["--fsdp", "--mesh", "hsdp"], 2)}
# (pipeline, path, model): ElasticStream cannot reshard in place (live=True is refused at
# start), so it takes the restart path only; FSDP2 and HSDP (sharded=) on the constant-batch
# pipeline, both paths (HSDP re-forms in place on the live path: a node is a replica).
ALL = ([(p, path, "ddp") for p in sorted(PIPELINES) for path in ("live", "restart")
        if (p, path) != ("stream", "live")]
       + [("batch-sampler", path, m) for m in ("fsdp", "hsdp") for path in ("live", "restart")])
# In the suite: the two pipelines whose counting a re-formation used to break (issue 45),
# live. The rest of ALL is soak-marked and exists only under ELASTICD_SOAK=1 (make soak
# runs them). Of the freeze/stop/start schedule the suite runs one job, drop_last=True on
# the restart path (24 s at load 20 on the shared 2-core machine; at load 30-130 the
# freeze jobs took 122-450 s, the kill/join/drain jobs 127-405 s). Its early
# failures were explained and fixed: a thawed worker that adopted a later epoch trained it
# under its stale epoch (ElasticLoop.batches() now ends that epoch), and the test waited
# for a step that a slow rejoin or a restart had already passed.
SUITE = [("batch-sampler", "live", "ddp"), ("distributed-drop-last", "live", "ddp")]
SUITE_FREEZE = [("distributed-drop-last", "restart", "ddp")]


def _cases(suite: list[tuple[str, str, str]]) -> list:
    soak = [c for c in ALL if c not in suite] if SOAK else []
    return ([pytest.param(*c, id=_id(c)) for c in suite]
            + [pytest.param(*c, id=_id(c), marks=pytest.mark.soak) for c in soak])


def _id(case: tuple[str, str, str]) -> str:
    return "-".join(case if case[2] != "ddp" else case[:2])


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


def _waits(trace: Path, step: int, after_round: int) -> dict[int, set[int]]:
    """world size -> ranks waiting before ``step`` in a round after ``after_round``."""
    out: dict[int, set[int]] = {}
    for r in read_jsonl(Path(str(trace) + ".wait")):
        if r["waiting"] == step and (r["round"] or 0) > after_round:
            out.setdefault(r["world_size"], set()).add(r["rank"])
    return out


def _round(trace: Path) -> int:
    return max([(r["round"] or 0) for r in read_jsonl(Path(str(trace) + ".wait"))], default=0)


def _hold_at(hold: Path, trace: Path, step: int, world: int, after_round: int = -1,
             timeout_s: float = 120) -> None:
    """Let the job train up to ``step`` and wait until all ``world`` ranks wait there."""
    _hold(hold, step)
    wait_until(lambda: len(_waits(trace, step, after_round).get(world, ())) == world, timeout_s,
               lambda: f"{world} ranks waiting before step {step}: {_waits(trace, step, after_round)}")


def _newest_waits(trace: Path, step: int, since_round: int) -> tuple[int, dict[int, set[int]]]:
    """The newest step at or after ``step`` that a rank waits before in round
    ``since_round`` or later, and who waits there (``(step, {})`` while nobody does)."""
    steps = [r["waiting"] for r in read_jsonl(Path(str(trace) + ".wait"))
             if r["waiting"] >= step and (r["round"] or 0) >= since_round]
    newest = max(steps, default=step)
    return newest, _waits(trace, newest, since_round - 1)


def _step_until_world(hold: Path, trace: Path, step: int, world: int, since_round: int,
                      ended: Callable[[], bool] | None = None) -> int:
    """Release one step at a time (each time a rank waits again, in round ``since_round`` or
    later) until ``world`` ranks wait together: a join or a drain acts at a step boundary,
    which a held job must reach. A restart may resume past ``step`` (from a checkpoint taken
    later): the newest waiting step counts. Returns the step they wait before, or -1 once
    ``ended()`` says the job ran to its end first."""
    for _ in range(12):
        def seen(s: int = step) -> object:
            if ended is not None and ended():
                return (-1, {})
            newest, waits = _newest_waits(trace, s, since_round)
            return (newest, waits) if waits else None
        step, waits = wait_until(seen, 120, lambda s=step: f"a rank waiting before step {s} or later")
        if step < 0:
            return -1
        if len(waits.get(world, ())) == world:
            return step
        step += 1
        _hold(hold, step)
    raise AssertionError(f"world size {world} never reached: {_waits(trace, step, since_round - 1)}")


# The fault-free runs of this pytest process, by their arguments: several cases share one.
_REFERENCES: dict[tuple[str, ...], tuple[Counter, dict]] = {}


def _reference(tmp_path: Path, args: list[str]) -> tuple[Counter, dict]:
    if tuple(args) not in _REFERENCES:
        _REFERENCES[tuple(args)] = _fault_free_run(tmp_path, args)
    want, params = _REFERENCES[tuple(args)]
    return Counter(want), dict(params)


def _fault_free_run(tmp_path: Path, args: list[str]) -> tuple[Counter, dict]:
    trace = tmp_path / "trace-ref.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    live = [] if "stream" in args else ["--live"]
    run = subprocess.run([PY, SCRIPT, *args, "--trace", str(trace), *live,
                          "--shard-dir", str(tmp_path / "shards-ref"),
                          "--checkpoint-url", f"file://{tmp_path}/ckpt-ref",
                          "--final-params", str(tmp_path / "final-ref.pt")],
                         cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return _ledger(trace), torch.load(tmp_path / "final-ref.pt", weights_only=True)


def _job_args(tmp_path: Path, pipeline: str, path: str, model: str) -> list[str]:
    return [*PIPELINES[pipeline][0], "--dataset-size", str(DATASET), "--epochs", str(EPOCHS),
            "--hold", str(tmp_path / "hold"), "--trace", str(tmp_path / "trace-run.jsonl"),
            "--checkpoint-url", f"file://{tmp_path}/ckpt-run",
            "--shard-dir", str(tmp_path / "shards-run"),
            "--final-params", str(tmp_path / "final-run.pt")] + (
        ["--live"] if path == "live" else []) + MODELS[model][0]


def _ledger_rows(tmp_path: Path, wrong: Counter) -> str:
    """The run's ledger rows (step round epoch world rank pid, first indices) that hold a
    sample of ``wrong``'s, and every epoch each such sample was trained in: what a CI log
    needs to tell a mislabelled step from a skipped or retrained one."""
    ids = {i for _, i in wrong}
    rows = [r for r in read_jsonl(tmp_path / "trace-run.jsonl") if ids & set(r["idx"])]
    return "ledger rows with those samples:\n" + "\n".join(
        f"  step={r['step']} round={r['round']} epoch={r['epoch']} world={r['world_size']} "
        f"rank={r['rank']} pid={r['pid']} idx={r['idx'][:4]}" for r in rows[:40])


def kill_join_drain(nodes, job: str, script: str, args: list[str], hold: Path, trace: Path,
                    at: tuple[int, int, int], *, env: dict[str, str] | None = None,
                    wait_s: float = 120, nproc: int = 1) -> None:
    """The schedule every exactly-once job shares: nodes a and b train; b is SIGKILLed at
    step ``at[0]`` (the survivor trains alone), c joins at ``at[1]`` (2 nodes again), c's
    agent is SIGTERMed at ``at[2]`` (a drain: 1 node); then a and c must exit 0. Each node
    runs ``nproc`` workers (world size ``nproc`` per node)."""
    kill_at, join_at, drain_at = at
    one, two = nproc, 2 * nproc
    _hold(hold, 0)
    a = nodes.start(job, script, nnodes="1:2", nproc=nproc, name="a", script_args=args, env=env)
    b = nodes.start(job, script, nnodes="1:2", nproc=nproc, name="b", script_args=args, env=env)
    _hold_at(hold, trace, 0, two)
    _hold_at(hold, trace, kill_at, two)
    before = _round(trace)
    b.signal(signal.SIGKILL)
    _hold_at(hold, trace, join_at, one, after_round=before)  # the survivor alone
    before = _round(trace)
    c = nodes.start(job, script, nnodes="1:2", nproc=nproc, name="c", script_args=args, env=env)
    # The survivor asks its held workers to stop at their next step for the joiner (a live
    # park, or the restart path's resize): the hold then moves on, one step at a time. (Until
    # 2026-12-07 the restart path's resize was not waited for: the held workers never reached
    # a step, and the join waited out the 30 s resize grace and a 30 s SIGTERM: 60 s of the
    # Lightning and HF jobs.)
    wait_until(lambda: "rendezvous_completed" in c.log() or "live_park_requested" in a.log()
               or "resize_started" in a.log(), 120, "the joiner registered")
    _step_until_world(hold, trace, join_at, two, before)
    _hold_at(hold, trace, drain_at, two)
    before = _round(trace)
    c.signal_agent(signal.SIGTERM)
    wait_until(lambda: "drain_started" in c.log(), 60, "the drain started")
    _step_until_world(hold, trace, drain_at, one, before)
    hold.unlink()
    for node in (a, c):
        assert node.wait(wait_s) == 0, node.log()[-4000:]


def assert_once(got: Counter, every: Counter,
                detail: Callable[[Counter], str] = lambda wrong: "") -> None:
    """Every (epoch, sample) of ``every`` trained exactly once in ``got``; on a failure the
    message ends with ``detail(the wrong samples)``."""
    missing, twice = every - got, got - every
    assert not missing and not twice, (f"{sum(missing.values())} samples never trained, e.g. "
                                       f"{sorted(missing)[:6]}; {sum(twice.values())} extra, e.g. "
                                       f"{sorted(twice)[:6]}; {detail(missing + twice)}")


def _audit(tmp_path: Path, pipeline: str, model: str, worlds: frozenset | None = None) -> int:
    """The run's ledger against a fault-free run's (and its final parameters where the
    global batch is constant); returns the samples audited. ``worlds``: the world sizes
    the run must have trained at (default: one node's and two nodes')."""
    nproc = MODELS[model][1]
    worlds = frozenset({nproc, 2 * nproc}) if worlds is None else worlds
    got = _ledger(tmp_path / "trace-run.jsonl")
    want, want_params = _reference(tmp_path, [*PIPELINES[pipeline][0], "--dataset-size",
                                              str(DATASET), "--epochs", str(EPOCHS)]
                                   + (["--model", "mlp"] if model != "ddp" else []))
    every = Counter((e, i) for e in range(EPOCHS) for i in range(DATASET))
    assert want == every, f"fault-free run: {sorted((want - every) + (every - want))[:10]}"
    assert_once(got, every, lambda wrong: _ledger_rows(tmp_path, wrong))
    seen = {r["world_size"] for r in read_jsonl(tmp_path / "trace-run.jsonl")}
    assert seen == worlds, seen
    if PIPELINES[pipeline][4]:
        got_params = torch.load(tmp_path / "final-run.pt", weights_only=True)
        for name, value in want_params.items():
            assert torch.allclose(value, got_params[name], rtol=1e-9, atol=1e-12), name
    return sum(got.values())


@pytest.mark.parametrize(("pipeline", "path", "model"), _cases(SUITE))
def test_kill_join_drain_train_every_sample_once(nodes, tmp_path, pipeline, path, model):
    """A 2-node job loses a node mid-epoch (SIGKILL), gains one mid-epoch (join) and drains
    one mid-epoch (SIGTERM to its agent), and still trains every sample of every epoch
    exactly once: the ledger equals a fault-free run's, and with a constant global batch
    so do the final parameters."""
    _, kill_at, join_at, drain_at, _ = PIPELINES[pipeline]
    kill_join_drain(nodes, "once", SCRIPT, _job_args(tmp_path, pipeline, path, model),
                    tmp_path / "hold", tmp_path / "trace-run.jsonl", (kill_at, join_at, drain_at),
                    nproc=MODELS[model][1])
    audited = _audit(tmp_path, pipeline, model)
    print(f"audited {audited} sample-epochs")


@pytest.mark.parametrize(("pipeline", "path", "model"), _cases(SUITE_FREEZE))
def test_freeze_thaw_stop_start_train_every_sample_once(nodes, tmp_path, pipeline, path, model):
    """A 2-node job whose node b is frozen mid-epoch (SIGSTOP of its whole process tree)
    trains on alone, takes b back when it is thawed (SIGCONT), is stopped mid-epoch
    (`elasticd stop`) and started again (`elasticd start`, both agents restarted), and
    still trains every sample of every epoch exactly once, with the parameters of a
    fault-free run where the global batch is constant."""
    _, freeze_at, thaw_at, stop_at, _ = PIPELINES[pipeline]
    job, ep = "freeze", nodes.etcd.endpoint
    hold, trace = tmp_path / "hold", tmp_path / "trace-run.jsonl"
    args = _job_args(tmp_path, pipeline, path, model)
    nproc = MODELS[model][1]
    one, two = nproc, 2 * nproc
    _hold(hold, 0)
    a = nodes.start(job, SCRIPT, nnodes="1:2", name="a", nproc=nproc, script_args=args)
    b = nodes.start(job, SCRIPT, nnodes="1:2", name="b", nproc=nproc, script_args=args)
    _hold_at(hold, trace, 0, two)
    _hold_at(hold, trace, freeze_at, two)
    before = _round(trace)
    b.signal(signal.SIGSTOP)
    try:  # a alone: its collective with b hangs until b's lease expires
        _hold_at(hold, trace, thaw_at, one, after_round=before)
    finally:
        b.signal(signal.SIGCONT)
    before = _round(trace)
    # b back in a new round. Its agent may have lost the lease before its worker noticed
    # the dead collective: then it kills the thawed worker and starts another, which under
    # load can take until after stop_at while a trains on alone: stop where both are.
    step = max(stop_at, _step_until_world(hold, trace, thaw_at, two, before))
    _hold_at(hold, trace, step, two)
    assert main(["stop", "--job", job, "--etcd", ep, "--wait", "0"]) == 0
    while a.alive() or b.alive():  # the stop acts at a step boundary: release one at a time
        step += 1
        _hold(hold, step)
        wait_until(lambda s=step: not (a.alive() or b.alive()) or _waits(trace, s, -1), 120,
                   lambda s=step: f"the stopped agents leaving, or a rank waiting before step {s}")
    for node in (a, b):
        assert node.wait(60) == 0, node.log()[-4000:]
    stopped = max(r["step"] for r in read_jsonl(trace))
    before = _round(trace)
    # Held right after the stop point: if the first round after the start closes with one
    # node (the other agent slow to register), that node must not train on to the job's end
    # alone, where no world of 2 would ever wait.
    _hold(hold, stopped + 1)
    assert main(["start", "--job", job, "--etcd", ep]) == 0
    a = nodes.start(job, SCRIPT, nnodes="1:2", name="a2", nproc=nproc, script_args=args)
    b = nodes.start(job, SCRIPT, nnodes="1:2", name="b2", nproc=nproc, script_args=args)
    # A join on the restart path acts at a step boundary, so a node alone in the first
    # round (its peer's agent slow to register under load) trains on until the join acts,
    # and with few steps left it may finish the job first: then the audit still applies.
    # The hold moves on only once both nodes are in (one round), or the one alone has been
    # asked to make room for the other: the suite with three workers once spent all of
    # _step_until_world's steps while a2's agent was still starting its standbys (5 s).
    wait_until(lambda: all("rendezvous_completed" in n.log() for n in (a, b))
               or any(e in n.log() for n in (a, b) for e in ("resize_started", "live_park_requested"))
               or not (a.alive() or b.alive()), 120, "both started nodes in the job")
    if _step_until_world(hold, trace, stopped + 1, two, before + 1,
                         ended=lambda: not (a.alive() or b.alive())) < 0:
        print("after the start one node finished the job before the other joined")
    hold.unlink()
    for node in (a, b):
        assert node.wait(120) == 0, node.log()[-4000:]
    audited = _audit(tmp_path, pipeline, model)
    print(f"audited {audited} sample-epochs")


def test_stale_sharded_module_after_live_reform_exits_78_naming_loop_model(nodes, tmp_path):
    """A live FSDP2 job whose script trains the start's module, not ``loop.model``, loses a
    node: the survivor re-forms, and its next step exits 78 with one message naming
    ``loop.model``, not c10d's 'not initialized in the world group map' crash (issue 45)."""
    hold, trace = tmp_path / "hold", tmp_path / "trace.jsonl"
    args = ["--pipeline", "batch-sampler", "--global-batch", "16", "--dataset-size", "96",
            "--fsdp", "--stale-model", "--live", "--hold", str(hold), "--trace", str(trace),
            "--checkpoint-url", f"file://{tmp_path}/ckpt"]
    _hold(hold, 0)
    a = nodes.start("stale", SCRIPT, nnodes="1:2", name="a", script_args=args)
    b = nodes.start("stale", SCRIPT, nnodes="1:2", name="b", script_args=args)
    _hold_at(hold, trace, 2, 2)
    b.signal(signal.SIGKILL)
    _hold(hold, 10)
    wait_until(lambda: not a.alive(), 120, "the survivor's agent to exit")
    log = a.log()
    assert a.wait(5) == 78, log[-4000:]
    assert "live_reformed" in log, log[-4000:]
    assert "after a re-formation use loop.model (sharded=) or the module loop.ddp()" in log, log[-4000:]


def test_worker_crash_before_any_checkpoint_keeps_the_survivors_steps(nodes, tmp_path):
    """A live 2-node job with no checkpoint yet loses one worker (its agent alive) while the
    job re-forms for that very crash: the peers saw the worker's connections close, and its
    own agent joined the re-formation before it saw the worker die (a race that loaded
    machines lost, issue 45's). The node restarts its worker into the round being
    re-formed, the job goes on from the survivors' in-memory state, never from step 0, and
    still trains every sample of every epoch exactly once."""
    pipeline, crash_at = "batch-sampler", 3
    hold, trace, sever = tmp_path / "hold", tmp_path / "trace-run.jsonl", tmp_path / "sever"
    args = [*_job_args(tmp_path, pipeline, "live", "ddp"), "--sever", str(sever)]
    _hold(hold, 0)
    # The crashed worker's replacement is a cold process (its warm standby was handed over
    # at the start): on a loaded machine its torch import alone can outlast the default
    # 30 s bound on a re-formation, which then falls back to the restart path.
    extra = ["--live-reform-timeout", "180"]
    a = nodes.start("crash", SCRIPT, nnodes="1:2", name="a", script_args=args, extra=extra)
    b = nodes.start("crash", SCRIPT, nnodes="1:2", name="b", script_args=args, extra=extra)
    _hold_at(hold, trace, 0, 2)
    _hold_at(hold, trace, crash_at, 2)
    assert not list((tmp_path / "ckpt-run").rglob("manifest.json")), "a checkpoint already"
    before = _round(trace)
    pids = {r["pid"] for r in read_jsonl(trace)} & set(b.tree())
    assert len(pids) == 1, pids
    pid = pids.pop()
    # b's worker closes its connections and lives on: b's agent sees it healthy until the
    # kill below, as its monitor did when the crash raced the re-formation under load.
    _hold(sever, pid)
    wait_until(Path(f"{sever}.done").exists, 60, "b's worker closing its connections")
    _hold(hold, crash_at + 1)  # a's step crash_at fails on the closed connections
    # a re-forms live; b's agent, its worker still running, joins the round and orders it in.
    wait_until(lambda: "live_reform_ordered" in b.log(), 120, "b's agent ordering its worker "
               "into the re-formed round")
    os.kill(pid, signal.SIGKILL)  # the crash, during the re-formation
    _step_until_world(hold, trace, crash_at + 1, 2, before + 1)
    after = [r for r in read_jsonl(trace) if (r["round"] or 0) > before]
    assert min(r["step"] for r in after) >= crash_at, (
        f"the job went back to step {min(r['step'] for r in after)} after one worker's crash")
    assert "live_reform_fell_back" not in a.log(), a.log()[-4000:]
    hold.unlink()
    for node in (a, b):
        assert node.wait(120) == 0, node.log()[-4000:]
    _audit(tmp_path, pipeline, "ddp", worlds=frozenset({2}))  # b's node never left
