"""End to end, sharded: an HSDP job (2 nodes x 2 workers) through a node kill and a join
trains the same model as a run without faults (issue 23 item 5, restart path).

examples/fsdp_train.py in float64: (a) without faults, one process (the model is a function
of the global batch only, so world size 1 is the reference; the suite's time is spent on
(b)); (b) on real agents, 2 x 2, one node SIGKILLed (the whole node: agent and workers), 1 x 2 on the survivor, a new node
joins, 2 x 2 again. Every re-formation restarts the workers, which shard the model on
the new mesh and load the sharded checkpoint resharded to it. The final gathered
parameters must be ``allclose`` (rtol 1e-9: only the reduction order differs), every
sample trained exactly once (each step's final attempt), the learning rate of every step
the scheduler's in (a), and gradient accumulation 2 at world size 2 (1 at 4).

No pacing: the workers train at full speed up to the step named in a hold file and wait
there (``--hold-file``, a collective wait that still stops for a drain), so the kill lands
at world 4 and the joiner's agent is admitted before the survivor finishes alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness import ROOT, agent_events, example_args, read_jsonl, trained_samples, wait_until

SCRIPT = str(ROOT / "examples" / "fsdp_train.py")
STEPS = 24
DRAIN_AT = 19  # the pure FSDP2 kill/join job's last phase: its joiner drained after this step
pytestmark = pytest.mark.timeout(300)


def _run(tmp_path, tag: str) -> tuple[list[str], list[str]]:
    script = example_args(tmp_path, tag, steps=STEPS, dataset_size=240) + ["--mesh", "hsdp"]
    script[script.index("--checkpoint-every") + 1] = "3"
    script[script.index("--step-sleep") + 1] = "0"
    return ["--checkpoint-url", f"file://{tmp_path}/ckpt-{tag}"], script


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    """(a), the fault-free run at world 1, once for the module: every test here compares its
    (b) with the same run (the same arguments, a function of the global batch only)."""
    where = tmp_path_factory.mktemp("fsdp-reference")
    extra, script = _run(where, "a")
    script[script.index("--checkpoint-every") + 1] = str(STEPS)  # saves do not change the math
    run = subprocess.run([sys.executable, SCRIPT, *script, *extra], capture_output=True,
                         cwd=where, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=240,
                         check=False)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    return where


def _reference(reference_dir: Path, tmp_path: Path) -> None:
    """(a)'s trace and final parameters where ``_check`` reads them."""
    for name in ("trace-a.jsonl", "final-a.pt"):
        shutil.copy(reference_dir / name, tmp_path / name)


def _hold_after(path, step: int | None) -> None:
    """Workers wait after ``step`` (and any later one) until this changes; None: no hold."""
    if step is None:
        path.unlink()
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, path)


def _two_fsdp_nodes(nodes, tmp_path, tag: str, job: str, *, steps: int, replica_every: int,
                    hold_at: int) -> tuple[list, Path, Path]:
    """Pure FSDP2 ``--live`` over 2 nodes x 1, held after step ``hold_at`` until both
    ranks reached it; returns (nodes, hold file, trace)."""
    extra, script = _run(tmp_path, tag)
    script[script.index("--steps") + 1] = str(steps)
    script[script.index("--mesh") + 1] = "fsdp"
    hold = tmp_path / "hold"
    script += ["--hold-file", str(hold), "--live", "--peer-replica-every", str(replica_every)]
    trace = tmp_path / f"trace-{tag}.jsonl"
    _hold_after(hold, hold_at)
    b = [nodes.start(job, SCRIPT, nnodes="1:2", nproc=1, extra=extra, script_args=script)
         for _ in range(2)]
    wait_until(lambda: any(r["step"] >= hold_at and r["rank"] == 1 for r in read_jsonl(trace)), 120,
               f"step {hold_at} at world 2")
    return b, hold, trace


def _last_attempts(rows: list[dict]) -> dict[int, dict]:
    last: dict[int, dict] = {}
    for r in rows:
        if r["rank"] == 0 and (r["step"] not in last or (r["round"] or 0) >= (last[r["step"]]["round"] or 0)):
            last[r["step"]] = r
    return last


def test_hsdp_kill_and_join_trains_the_same_model_as_no_faults(nodes, tmp_path, reference_dir):
    """2x2 HSDP, SIGKILL of one node, 1x2, a join, 2x2: final parameters equal a fault-free
    run's, every sample trained once, LR schedule and accumulation carried over."""
    _run_b(nodes, tmp_path)
    _reference(reference_dir, tmp_path)
    _check(tmp_path)


def _run_b(nodes, tmp_path) -> None:
    """(b): 2 x 2, a node SIGKILLed at step 9, 1 x 2 up to step 14, a join, 2 x 2 to the end."""
    extra, script = _run(tmp_path, "b")
    hold = tmp_path / "hold"
    script += ["--hold-file", str(hold)]
    trace = tmp_path / "trace-b.jsonl"
    _hold_after(hold, 9)  # world 4 trains steps 0-9 and waits for the kill
    b = [nodes.start("fsdp-b", SCRIPT, nnodes="1:2", nproc=2, extra=extra, script_args=script)
         for _ in range(2)]
    wait_until(lambda: any(r["step"] >= 9 and r["rank"] == 3 for r in read_jsonl(trace)), 120,
               "step 9 at world 4")
    b[1].signal(signal.SIGKILL)
    at_kill = max(r["round"] or 0 for r in read_jsonl(trace))
    _hold_after(hold, 14)  # the survivor trains on alone (from the last save) up to step 14
    wait_until(lambda: any((r["round"] or 0) > at_kill and r["rank"] == 1 for r in read_jsonl(trace)),
               120, "training at world 2 after the kill")
    at_shrink = max(r["round"] or 0 for r in read_jsonl(trace))
    # The joiner is admitted through a drain of the held survivor, then world 4 trains on.
    b.append(nodes.start("fsdp-b", SCRIPT, nnodes="1:2", nproc=2, extra=extra, script_args=script))
    wait_until(lambda: any((r["round"] or 0) > at_shrink and r["rank"] == 3 for r in read_jsonl(trace)),
               150, "world 4 again after the join")
    _hold_after(hold, None)
    for n in (b[0], b[2]):
        assert n.wait(150) == 0, n.log()[-3000:]
    assert "checkpoint_loaded" in b[2].log(), "the joiner did not load the sharded checkpoint"


def _check(tmp_path) -> None:
    trace = tmp_path / "trace-b.jsonl"
    rows = read_jsonl(trace)
    worlds = {(r["round"] or 0): 1 + max(x["rank"] for x in rows if x["round"] == r["round"]) for r in rows}
    assert {2, 4} <= set(worlds.values()), f"the run never changed world size: {worlds}"

    a_params = torch.load(tmp_path / "final-a.pt", weights_only=True)
    b_params = torch.load(tmp_path / "final-b.pt", weights_only=True)
    assert a_params.keys() == b_params.keys()
    for name, value in a_params.items():
        assert torch.allclose(value, b_params[name], rtol=1e-9, atol=1e-12), name
    assert trained_samples(tmp_path / "trace-a.jsonl") == trained_samples(trace)
    ref_steps, got_steps = _last_attempts(read_jsonl(tmp_path / "trace-a.jsonl")), _last_attempts(rows)
    assert sorted(got_steps) == list(range(STEPS))
    assert all(got_steps[s]["lr"] == ref_steps[s]["lr"] for s in range(STEPS)), "LR schedule changed"
    accumulation = {worlds[r["round"] or 0]: r["accumulation"] for r in rows}
    assert accumulation == {4: 1, 2: 2}, accumulation


def _live_kill_then_join(nodes, job: str, extra: list[str], script: list[str], hold: Path,
                         trace: Path, held: Callable[[list[dict]], bool], what: str
                         ) -> tuple[list, set[int], int, int]:
    """2 x 2 ``--live`` held after step 9 (until ``held(rows)``), one node SIGKILLed, the
    survivors on alone up to step 14, a joiner, world 4 again. Returns the nodes, the
    survivors' worker PIDs and the rounds at the kill and after the shrink."""
    _hold_after(hold, 9)
    b = [nodes.start(job, SCRIPT, nnodes="1:2", nproc=2, extra=extra, script_args=script)
         for _ in range(2)]
    wait_until(lambda: held(read_jsonl(trace)), 120, f"{what} at world 4")
    victim = set(b[1].tree())
    survivors = {r["pid"] for r in read_jsonl(trace)} - victim
    assert len(survivors) == 2, survivors
    b[1].signal(signal.SIGKILL)
    at_kill = max(r["round"] or 0 for r in read_jsonl(trace))
    _hold_after(hold, 14)
    wait_until(lambda: any((r["round"] or 0) > at_kill and r["rank"] == 1 for r in read_jsonl(trace)),
               60, "training at world 2 after the kill")
    at_shrink = max(r["round"] or 0 for r in read_jsonl(trace))
    b.append(nodes.start(job, SCRIPT, nnodes="1:2", nproc=2, extra=extra, script_args=script))
    wait_until(lambda: any((r["round"] or 0) > at_shrink and r["rank"] == 3 for r in read_jsonl(trace)),
               90, "world 4 again after the join")
    return b, survivors, at_kill, at_shrink


def test_hsdp_live_kill_and_join_keeps_the_survivors_and_their_shards(nodes, tmp_path, reference_dir):
    """2x2 HSDP with ``--live``: a node SIGKILLed, the survivor's two workers re-form 1x2 in
    place (same PIDs, their own shards), a joiner gets its shards from a peer (no
    checkpoint read), 2x2 again: final parameters equal a fault-free run's, every sample
    once, no completed step trained twice, LR schedule and accumulation carried over."""
    extra_b, script_b = _run(tmp_path, "b")
    hold = tmp_path / "hold"
    script_b += ["--hold-file", str(hold), "--live"]
    trace = tmp_path / "trace-b.jsonl"
    # Every rank held after step 9, not only rank 3: a kill while a survivor is still
    # inside step 9's collectives leaves the survivors a step apart (a torn replica),
    # which rightly falls back to the checkpoint instead of re-forming in place.
    b, survivors, at_kill, at_shrink = _live_kill_then_join(
        nodes, "hsdp-live", extra_b, script_b, hold, trace, lambda rows: {
            r["rank"] for r in rows if r["step"] >= 9} == {0, 1, 2, 3}, "every rank held after step 9")
    _hold_after(hold, None)
    for n in (b[0], b[2]):
        assert n.wait(120) == 0, n.log()[-3000:]
    _reference(reference_dir, tmp_path)
    _check(tmp_path)
    rows = read_jsonl(trace)
    alone = {r["pid"] for r in rows if at_kill < (r["round"] or 0) <= at_shrink}
    last = max(r["round"] or 0 for r in rows)
    rejoined = {r["pid"] for r in rows if (r["round"] or 0) == last}
    assert alone == survivors, f"a survivor's worker was restarted (no live re-formation): {alone}"
    assert survivors < rejoined and len(rejoined) == 4, f"the survivors did not train on: {rejoined}"
    assert "checkpoint_loaded" not in b[2].log(), "the joiner read the checkpoint"
    assert "live_shards_received" in b[2].log()
    per_rank0 = [r["step"] for r in rows if r["rank"] == 0]
    assert len(per_rank0) == len(set(per_rank0)), "a completed step was trained twice"


def test_hsdp_live_survivor_with_a_nan_shard_is_never_a_source_and_the_job_loads_the_checkpoint(nodes, tmp_path, reference_dir):
    """2x2 HSDP with ``--live``: a survivor's shard turned NaN while held after step 9 (a
    silent corruption), then the other node SIGKILLed. The poisoned rank offers no state,
    so no intact replica holds its shard: the re-formation falls back one tier, the
    checkpoint (step 8), instead of training on with NaN; the final parameters equal a
    fault-free run's and every sample is trained once."""
    extra_b, script_b = _run(tmp_path, "b")
    hold, poison = tmp_path / "hold", tmp_path / "poison"
    script_b += ["--hold-file", str(hold), "--poison-file", str(poison), "--live"]
    trace = tmp_path / "trace-b.jsonl"
    _hold_after(hold, 9)
    b = [nodes.start("hsdp-nan", SCRIPT, nnodes="1:2", nproc=2, extra=extra_b,
                     script_args=script_b) for _ in range(2)]
    wait_until(lambda: {r["rank"] for r in read_jsonl(trace) if r["step"] >= 9} == {0, 1, 2, 3}, 120,
               "every rank held after step 9 at world 4")
    victim = set(b[1].tree())
    survivor_ranks = {r["rank"] for r in read_jsonl(trace) if r["pid"] not in victim}
    assert len(survivor_ranks) == 2, survivor_ranks
    poison.write_text(str(min(survivor_ranks)))
    done = tmp_path / "poison.done"
    wait_until(done.exists, 30, "the survivor's shard poisoned")
    b[1].signal(signal.SIGKILL)
    _hold_after(hold, None)
    assert b[0].wait(180) == 0, b[0].log()[-3000:]
    _reference(reference_dir, tmp_path)
    _check(tmp_path)  # no NaN trained on: the final parameters are the fault-free run's
    log = b[0].log()
    assert "live_shards_not_offered" in log, log[-3000:]
    assert "live_reform_fell_back" in log and "checkpoint_loaded" in log, log[-3000:]


def test_fsdp_live_kill_join_and_drain_reshard_in_memory_and_train_the_same_model(nodes, tmp_path,
                                                                                   reference_dir):
    """Pure FSDP2 with ``--live`` over 2 nodes x 2, peer-RAM replica every 4 steps: a node
    SIGKILLed at step 9 takes half the shards with it; the survivor's two workers (same
    PIDs) rebuild them from the replicas they hold (step 8: one step rolled back, sampler
    and LR with it) and reshard 4 -> 2 in memory; a joiner is resharded into 2 -> 4 from the
    live shards; that joiner drained (SIGTERM to its agent) at step 19 hands its shards on:
    every rank refreshes the replica at the agreed stop, so the survivor reshards 4 -> 2 in
    memory at step 19 (0 rolled back). No checkpoint is read; the final parameters equal a
    fault-free run's and every sample is trained once (each step's last attempt)."""
    extra_b, script_b = _run(tmp_path, "b")
    script_b[script_b.index("--mesh") + 1] = "fsdp"
    hold = tmp_path / "hold"
    script_b += ["--hold-file", str(hold), "--live", "--peer-replica-every", "4"]
    trace = tmp_path / "trace-b.jsonl"
    b, survivors, at_kill, at_shrink = _live_kill_then_join(
        nodes, "fsdp-live", extra_b, script_b, hold, trace,
        lambda rows: any(r["step"] >= 9 and r["rank"] == 3 for r in rows), "step 9")
    # Phase 4: the joiner drained, all four ranks held after step DRAIN_AT.
    _hold_after(hold, DRAIN_AT)
    wait_until(lambda: any((r["round"] or 0) > at_shrink and r["rank"] == 3 and r["step"] >= DRAIN_AT
                           for r in read_jsonl(trace)), 90, f"step {DRAIN_AT} at world 4")
    at_join = max(r["round"] or 0 for r in read_jsonl(trace))
    b[2].signal_agent(signal.SIGTERM)
    assert b[2].wait(60) == 0, b[2].log()[-3000:]
    _hold_after(hold, None)
    assert b[0].wait(120) == 0, b[0].log()[-3000:]
    _reference(reference_dir, tmp_path)
    _check(tmp_path)
    rows = read_jsonl(trace)
    alone = {r["pid"] for r in rows if at_kill < (r["round"] or 0) <= at_shrink}
    assert alone == survivors, f"a survivor's worker was restarted (no live re-formation): {alone}"
    after_drain = {r["pid"] for r in rows if (r["round"] or 0) > at_join}
    assert after_drain == survivors, f"the drain restarted a survivor's worker: {after_drain}"
    for n in (b[0], b[2]):
        assert "checkpoint_loaded" not in n.log(), "a checkpoint was read"
    recovered = [line for line in b[0].log().splitlines() if "live_resharded_in_memory" in line
                 and "peer-RAM replicas" in line]
    assert recovered and '"steps_rolled_back": 1' in recovered[0], recovered
    drained = [line for line in recovered if f'"step": {DRAIN_AT}' in line]
    assert len(drained) == 2, recovered  # one line from each survivor's worker
    assert all('"steps_rolled_back": 0' in line for line in drained), drained
    assert "live_resharded_in_memory" in b[2].log(), "the joiner was not resharded in memory"
    per_rank0 = [r["step"] for r in rows if r["rank"] == 0]
    assert len(per_rank0) - len(set(per_rank0)) <= 4, "more steps retrained than the replica's k"


def test_live_fsdp_resize_falls_back_to_the_resharding_load_and_says_why(nodes, tmp_path):
    """Pure FSDP with ``--live`` over 2 nodes x 1 and no peer-RAM replica
    (``--peer-replica-every 0``): a node killed changes the shard size (2 -> 1) and its
    shard exists nowhere else: the survivor logs one ``live_reform_fell_back`` line naming
    the shard size change and the missing replica, and the job finishes on the restart
    path (the checkpoint resharded into a new worker)."""
    steps = 12
    b, hold, trace = _two_fsdp_nodes(nodes, tmp_path, "f", "fsdp-fb", steps=steps, replica_every=0,
                                     hold_at=5)
    b[1].signal(signal.SIGKILL)
    _hold_after(hold, None)
    assert b[0].wait(120) == 0, b[0].log()[-3000:]
    fell_back = [line for line in b[0].log().splitlines()
                 if "live_reform_fell_back" in line and '"source": "worker"' in line]
    assert len(fell_back) == 1, fell_back  # one line from the worker (and its agent's own)
    assert "shard size changes from 2 to 1" in fell_back[0], fell_back[0]
    assert "no peer-RAM replica" in fell_back[0], fell_back[0]
    assert "checkpoint_loaded" in b[0].log(), "the restart path did not reshard the checkpoint"
    assert sorted({r["step"] for r in read_jsonl(trace)}) == list(range(steps))


def test_fsdp_live_kill_loads_a_checkpoint_newer_than_the_replicas_instead(nodes, tmp_path):
    """Pure FSDP2 ``--live`` over 2 nodes x 1, a peer-RAM replica every 50 steps (held
    from step 0) and a checkpoint every 3 (after steps 2, 5, 8): a node SIGKILLed at step
    10, after step 8's checkpoint committed. The replicas would roll back 10 steps; the
    survivor's workers say so in one ``live_reform_fell_back`` line naming the newer
    checkpoint, restart and load step 8: two steps retrained, every step trained."""
    steps = 14
    b, hold, trace = _two_fsdp_nodes(nodes, tmp_path, "n", "fsdp-newer", steps=steps, replica_every=50,
                                     hold_at=10)
    wait_until(lambda: any(e.get("step") == 8 for n in b
                           for e in agent_events(n.log(), "checkpoint_committed")), 60, "step 8 committed")
    b[1].signal(signal.SIGKILL)
    _hold_after(hold, None)
    assert b[0].wait(120) == 0, b[0].log()[-3000:]
    log = b[0].log()
    fell_back = [line for line in log.splitlines() if "live_reform_fell_back" in line
                 and '"source": "worker"' in line]
    assert len(fell_back) == 1, fell_back
    assert "committed checkpoint (step 8) is newer than the replicas" in fell_back[0], fell_back[0]
    assert "checkpoint_loaded" in log, "the survivor did not load the checkpoint"
    per_rank0 = [r["step"] for r in read_jsonl(trace) if r["rank"] == 0]
    assert sorted(set(per_rank0)) == list(range(steps)), "a step was skipped"
    retrained = len(per_rank0) - len(set(per_rank0))
    assert retrained <= 2, f"{retrained} steps retrained: the replicas (step 0) were used"


def test_elastic_loop_fsdp_kill_recovers_from_the_peer_replicas_and_trains_every_sample_once(nodes, tmp_path):
    """``ElasticLoop(sharded=..., live=True)`` with a pure FSDP2 model over 2 nodes x 1,
    replica every 4 steps (and at each epoch's end): a node SIGKILLed mid-epoch; the
    survivor (same PID) rebuilds the lost shards from the replica it holds, rolls back at
    most 4 steps with the sampler, and trains on alone. No checkpoint is read, and the last
    attempt of every step covers each sample once per epoch."""
    script = str(ROOT / "tests" / "workers" / "fsdp_loop.py")
    trace = tmp_path / "trace-l.jsonl"
    extra = ["--checkpoint-url", f"file://{tmp_path}/ckpt-l"]
    # Every rank waits before step 6 until the kill has landed (--hold-file): the kill
    # never races the end of the 18-step job.
    hold = tmp_path / "hold-l"
    _hold_after(hold, 6)
    args = ["--trace", str(trace), "--epochs", "3", "--dataset-size", "48", "--batch", "4",
            "--hold-file", str(hold)]
    b = [nodes.start("fsdp-loop", script, nnodes="1:2", nproc=1, extra=extra, script_args=args)
         for _ in range(2)]
    wait_until(lambda: any(r["step"] >= 3 and r["world"] == 2 for r in read_jsonl(trace)), 120,
               "step 3 at world 2")
    victim = set(b[1].tree())
    b[1].signal(signal.SIGKILL)
    _hold_after(hold, None)
    assert b[0].wait(120) == 0, b[0].log()[-3000:]
    rows = read_jsonl(trace)
    survivor = {r["pid"] for r in rows if r["world"] == 1}
    assert len(survivor) == 1 and not survivor & victim, survivor
    assert survivor <= {r["pid"] for r in rows if r["world"] == 2}, "the survivor was restarted"
    recovered = [line for line in b[0].log().splitlines() if "live_resharded_in_memory" in line]
    assert len(recovered) == 1 and "peer-RAM replicas" in recovered[0], recovered
    rolled = int(recovered[0].split('"steps_rolled_back": ')[1].split(",")[0])
    assert 0 <= rolled <= 4, recovered[0]
    assert "checkpoint_loaded" not in b[0].log(), "the survivor read the checkpoint"
    last_round: dict[int, int] = {}
    for r in rows:
        last_round[r["step"]] = max(last_round.get(r["step"], -1), r["round"] or 0)
    per_epoch: dict[int, list[int]] = {}
    for r in rows:
        if (r["round"] or 0) == last_round[r["step"]]:
            per_epoch.setdefault(r["epoch"], []).extend(r["samples"])
    assert sorted(per_epoch) == [0, 1, 2]
    for epoch, samples in per_epoch.items():
        assert sorted(samples) == list(range(48)), f"epoch {epoch}: not every sample exactly once"
