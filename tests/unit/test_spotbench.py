"""The spot-trace replay's arithmetic (benchmarks/spotbench): each event's charge, by cause."""

from __future__ import annotations

import json

import pytest

from benchmarks.spotbench.costs import MissingMeasurement, costs_from_results, fixed_size
from benchmarks.spotbench.model import JobShape, Placement, SystemCosts, node_events, simulate
from benchmarks.spotbench.traces import TraceError, parse_trace

GAP = 300.0
LIVE = SystemCosts("live", kill_s=0.5, kill_rollback=False, uses_notice=True, drain_s=0.25,
                   join_s=5.0, join_pause_s=0.4, join_rollback=False, cold_start_s=3.0)
RESTART = SystemCosts("restart", kill_s=2.0, kill_rollback=True, uses_notice=False, drain_s=0.0,
                      join_s=10.0, join_pause_s=8.0, join_rollback=True, cold_start_s=3.0)
JOB = JobShape(min_nodes=1, max_nodes=4, checkpoint_every_s=600.0, notice_s=0.0)


def _adds_up(led) -> None:
    assert led.useful + sum(led.lost.values()) == pytest.approx(led.available, rel=1e-9)


def test_a_steady_pool_loses_only_the_cold_start():
    """Four nodes for an hour: the only badput is one cold start of the whole world."""
    led = simulate([4] * 13, GAP, LIVE, JOB, Placement.EARLY)
    assert led.available == pytest.approx(4 * 12 * GAP)
    assert led.lost == {"cold_start": pytest.approx(4 * 3.0)}
    _adds_up(led)


def test_a_kill_stalls_the_survivors_and_a_live_launcher_keeps_their_work():
    """A loss without notice: survivors stall kill_s; nothing is retrained in memory."""
    led = simulate([4, 3, 3], GAP, LIVE, JOB, Placement.MIDDLE)
    assert led.lost["kill"] == pytest.approx(3 * 0.5)
    assert "retrained" not in led.lost
    assert led.available == pytest.approx(4 * 150 + 3 * 450)
    _adds_up(led)


def test_a_restart_launcher_retrains_what_the_last_checkpoint_missed():
    """A kill 450 s in, checkpoint every 600 s: the 4-node world's 447 s since its cold start
    (3 s) are retrained, node-seconds and steps."""
    job = JobShape(min_nodes=1, max_nodes=4, checkpoint_every_s=600.0, step_s=1.0)
    led = simulate([4, 4, 3], GAP, RESTART, job, Placement.MIDDLE)
    assert led.lost["retrained"] == pytest.approx(4 * (450 - 3.0))
    assert led.steps_retrained == pytest.approx(447)
    assert led.lost["kill"] == pytest.approx(3 * 2.0)
    _adds_up(led)


def test_a_checkpoint_bounds_the_rollback():
    """With a checkpoint every 100 s of training, a kill retrains at most the last 100 s."""
    job = JobShape(min_nodes=1, max_nodes=4, checkpoint_every_s=100.0)
    led = simulate([4, 4, 3], GAP, RESTART, job, Placement.MIDDLE)
    # trained 447 s by the kill: checkpoints at 100..400 s of training, 47 s since.
    assert led.lost["retrained"] == pytest.approx(4 * 47.0)
    _adds_up(led)


def test_a_notice_drains_the_node_and_its_lead_is_paid_but_idle():
    """With a 120 s notice the node drains at the notice: the world stalls drain_s, the
    leaving node is held (paid) for its lead, nothing is retrained."""
    job = JobShape(min_nodes=1, max_nodes=4, notice_s=120.0)
    led = simulate([4, 3, 3], GAP, LIVE, job, Placement.MIDDLE)
    assert led.events.get("drain") == 1 and "kill" not in led.events
    assert led.lost["drain"] == pytest.approx(3 * 0.25)
    assert led.lost["notice_lead"] == pytest.approx(120.0)
    assert "retrained" not in led.lost
    _adds_up(led)


def test_a_launcher_that_ignores_notices_takes_the_loss_as_a_kill():
    """torchrun has no drain: with a notice the loss still rolls back to the checkpoint."""
    job = JobShape(min_nodes=1, max_nodes=4, notice_s=120.0)
    led = simulate([4, 3, 3], GAP, RESTART, job, Placement.MIDDLE)
    assert led.events.get("kill") == 1 and "notice_lead" not in led.lost
    assert led.lost["retrained"] > 0
    _adds_up(led)


def test_a_joiner_is_idle_while_it_starts_and_the_members_pause_for_the_end_of_it():
    """A join: the new node idles join_s; the 3 members pause for the last join_pause_s of
    it (recovery.py's join is arrival -> first step at the new world, and its pause ends at
    that same step), and the joiner is not charged the pause a second time."""
    led = simulate([3, 4, 4], GAP, LIVE, JOB, Placement.MIDDLE)
    assert led.lost["join_start"] == pytest.approx(5.0)
    assert led.lost["join_pause"] == pytest.approx(3 * 0.4)
    _adds_up(led)
    slow = simulate([3, 4, 4], GAP, RESTART, JOB, Placement.MIDDLE)
    assert slow.lost["join_start"] == pytest.approx(10.0)  # not 10 + 8
    assert slow.lost["join_pause"] == pytest.approx(3 * 8.0)
    _adds_up(slow)


def test_joiners_arriving_together_share_one_pause_of_the_members():
    """Two nodes arrive at once: the two members pause once (8 s), not once per joiner
    one after the other (a restart in progress admits both); each joiner idles its 10 s."""
    led = simulate([2, 4, 4], GAP, RESTART, JOB, Placement.EARLY)
    assert led.events["join"] == 2
    assert led.lost["join_start"] == pytest.approx(2 * 10.0)
    assert led.lost["join_pause"] == pytest.approx(2 * 8.0)
    _adds_up(led)


def test_a_fixed_size_job_waits_for_the_whole_pool():
    """A fixed 4-node job trains only with 4: at 3 its nodes wait (below_min), then it
    starts cold again."""
    fixed = fixed_size(RESTART)
    led = simulate([4, 3, 4, 4], GAP, fixed, JOB, Placement.EARLY)
    assert led.events["cold_start"] == 2
    assert led.lost["below_min"] == pytest.approx(3 * GAP)
    _adds_up(led)


def test_losing_the_store_host_ends_a_torchrun_job():
    """With the c10d store in one launcher, losing that node relaunches the whole job."""
    c10d = SystemCosts(**{**RESTART.__dict__, "store_host_fatal": True, "relaunch_s": 60.0})
    # Find a seed whose single loss hits node 0 (the store host at the cold start).
    seed = next(s for s in range(100)
                if [e.node for e in node_events([4, 3], GAP, Placement.MIDDLE, s, 0.0)] == [0])
    led = simulate([4, 3, 3], GAP, c10d, JOB, Placement.MIDDLE, seed)
    assert led.events["job_lost"] == 1 and led.events["cold_start"] == 2
    assert led.lost["cold_start"] == pytest.approx(4 * 3.0 + 3 * (60.0 + 3.0))
    _adds_up(led)


def test_below_min_the_elastic_job_waits_and_resumes_cold():
    """min 2: at 1 node the world stops (rolled back, the last one waiting), then starts cold."""
    job = JobShape(min_nodes=2, max_nodes=4)
    led = simulate([2, 1, 2, 2], GAP, LIVE, job, Placement.EARLY)
    assert led.lost["below_min"] == pytest.approx(1 * GAP)
    assert led.events["cold_start"] == 2
    _adds_up(led)


def test_placements_move_events_inside_the_tick():
    """Early, middle and late put one loss at 0, 150 and ~300 s into its interval."""
    at = {p: node_events([2, 1], GAP, p, 0, 0.0)[0].t for p in
          (Placement.EARLY, Placement.MIDDLE, Placement.LATE)}
    assert at[Placement.EARLY] == 0.0 and at[Placement.MIDDLE] == 150.0
    assert 299.0 < at[Placement.LATE] < 300.0
    uniform = {node_events([2, 1], GAP, Placement.UNIFORM, s, 0.0)[0].t for s in range(5)}
    assert len(uniform) == 5  # seeded, and different per seed


def test_a_trace_above_the_job_size_is_refused():
    """The model holds every available node; a pool above max_nodes is an error, not a guess."""
    with pytest.raises(ValueError, match="above max_nodes"):
        simulate([5, 5], GAP, LIVE, JOB)


@pytest.mark.parametrize("text", ['{"data": [1, 2]}', '{"metadata": {"gap_seconds": 0}, "data": [1, 2]}',
                                  '{"metadata": {"gap_seconds": 300}, "data": [1, -1]}',
                                  '{"metadata": {"gap_seconds": 300}, "data": [1]}', "not json"])
def test_bad_traces_are_refused_with_their_name(text):
    """A trace that is not positive-gap non-negative counts names the file."""
    with pytest.raises(TraceError, match="zone-a"):
        parse_trace("zone-a", text)


def _trial(system, scenario, recovery_s, pause_s=None, recovered=True):
    return {"system": system, "scenario": scenario, "recovered": recovered,
            "recovery_s": recovery_s, "pause_s": pause_s}


def test_costs_are_the_medians_of_the_recovered_trials():
    """Event costs come from a recovery run: medians of recovered trials, failures ignored."""
    trials = [_trial("elasticd-live", "sigkill", s) | {"steps_lost": 0} for s in (0.2, 0.3, 0.9)]
    trials += [_trial("elasticd-live", "sigkill", 99.0, recovered=False)]
    trials += [_trial("elasticd-live", "sigterm", 0.2), _trial("elasticd-live", "join", 4.9, 0.3)]
    costs = costs_from_results(json.loads(json.dumps({"trials": trials})), "elasticd-live")
    assert (costs.kill_s, costs.drain_s, costs.join_s, costs.join_pause_s) == (0.3, 0.2, 4.9, 0.3)
    assert not costs.kill_rollback and costs.uses_notice


def test_a_rollback_is_read_from_the_steps_the_run_lost():
    """A launcher whose killed trial lost steps rolls back on a kill; one that lost none on a
    join does not roll back on a join."""
    trials = [_trial("torchrun-etcd", "sigkill", 2.0) | {"steps_lost": 3},
              _trial("torchrun-etcd", "join", 8.0, 5.0) | {"steps_lost": 0}]
    costs = costs_from_results({"trials": trials}, "torchrun-etcd")
    assert costs.kill_rollback and not costs.join_rollback and not costs.uses_notice


def test_a_missing_measurement_names_the_command_to_run():
    """No join trial for a launcher: the error names the recovery run that would measure it."""
    with pytest.raises(MissingMeasurement, match="--systems torchrun-etcd --scenarios join"):
        costs_from_results({"trials": [_trial("torchrun-etcd", "sigkill", 2.0)]}, "torchrun-etcd")


def test_a_drain_lead_trains_through_the_rest_of_the_notice():
    """Draining with 60 s left of a 120 s notice idles the leaving node 60 s, not 120 s."""
    job = JobShape(min_nodes=1, max_nodes=4, notice_s=120.0)
    lead = SystemCosts(**{**LIVE.__dict__, "drain_lead_s": 60.0})
    led = simulate([4, 3, 3], GAP, lead, job, Placement.MIDDLE)
    assert led.lost["notice_lead"] == pytest.approx(60.0)
    _adds_up(led)


# -- the 7B HSDP projection (benchmarks/spotbench/projection.py) ----------------------------
def _phased(system, scenario, phases, **kw):
    return {"system": system, "scenario": scenario, "recovered": True, "phases": phases, **kw}


def test_the_projection_scales_state_bytes_over_the_stated_bandwidths():
    """112 GB per replica (7e9 x 16 B); over 3,200 Gb/s at 80 % and over S3's 100 Gb/s at 80 %."""
    from benchmarks.spotbench.projection import SOURCES, GpuJob

    g = GpuJob()
    assert g.state_bytes == pytest.approx(112e9)
    assert g.peer_transfer_s == pytest.approx(112e9 * 8 / (3200e9 * 0.8))  # 0.35 s
    assert g.ckpt_read_s == pytest.approx(11.2)
    assert GpuJob(nic_gbps=400.0).peer_transfer_s == pytest.approx(2.8)  # 8x less bandwidth
    # every assumption has its source, and every source names a field of the job
    assert set(SOURCES) <= set(GpuJob.__dataclass_fields__)


def test_the_projection_keeps_the_control_plane_and_adds_each_paths_gpu_parts():
    """Live: phases but the worker's kept, + NCCL (and a joiner's cold start, compile and
    peer transfer); restart: + the checkpoint read; torchrun: local minus a local worker start."""
    from benchmarks.spotbench.projection import GpuJob, project

    g = GpuJob(nccl_init_s=2.0, compile_cold_s=60.0, compile_cached_s=15.0,
               worker_cold_start_s=11.0, standby_start_s=1.0, local_worker_start_s=3.0)
    trials = [
        _phased("elasticd-live", "sigkill", {"detection": 0.1, "rendezvous": 0.05,
                                             "re-form + state + first step": 0.3}),
        _phased("elasticd-live", "sigterm", {"detection": 0.2, "rendezvous": 0.1,
                                             "re-form + state + first step": 0.3}),
        _phased("elasticd-live", "join", {"detection": 15.0, "rendezvous": 0.1,
                                          "re-form + state + first step": 0.5}),
        _phased("elasticd", "sigkill", {"detection": 0.4, "rendezvous": 0.1, "worker ready": 1.0,
                                        "first step": 0.1}),
        _phased("elasticd", "sigterm", {"detection": 0.1, "drain": 0.2, "worker ready": 0.5}),
        _phased("elasticd", "join", {"detection": 20.0, "drain": 20.0, "rendezvous": 0.1,
                                     "new agent start-up": 4.0, "worker ready": 10.0}),
    ]
    live = project(SystemCosts(**{**LIVE.__dict__, "name": "elasticd-live"}), trials, g)
    assert live.kill_s == pytest.approx(0.15 + 2.0)
    assert live.drain_s == pytest.approx(0.3 + 2.0)
    assert live.join_pause_s == pytest.approx(0.1 + g.peer_transfer_s + 2.0)
    assert live.join_s == pytest.approx(0.1 + 11.0 + 60.0 + g.peer_transfer_s + 2.0)
    assert live.cold_start_s == live.join_s
    restart = project(SystemCosts(**{**RESTART.__dict__, "name": "elasticd", "uses_notice": True}),
                      trials, g)
    assert restart.kill_s == pytest.approx(0.5 + 1.0 + g.ckpt_read_s + 15.0 + 2.0)
    # a drain on the restart path writes the replica, then restarts from it
    assert restart.drain_s == pytest.approx(0.3 + g.ckpt_write_s + 1.0 + g.ckpt_read_s + 15.0 + 2.0)
    assert restart.join_s == pytest.approx(0.1 + 11.0 + 60.0 + g.ckpt_read_s + 2.0)
    torch = project(SystemCosts(**{**RESTART.__dict__, "name": "torchrun-tuned"}), trials, g)
    assert torch.kill_s == pytest.approx(0.0 + 11.0 + g.ckpt_read_s + 15.0 + 2.0)
    assert torch.join_s == pytest.approx((10.0 - 3.0) + 11.0 + 60.0 + g.ckpt_read_s + 2.0)
    assert torch.drain_s == 0.0  # torchrun ignores the notice


def test_each_save_blocks_the_members_for_its_measured_copy():
    """save_block_s charges every member at each save (checkpoint_block): a steady hour of
    4 nodes saving every 100 s of training with a 1 s copy pays 35 copies, and adds up."""
    job = JobShape(min_nodes=1, max_nodes=4, checkpoint_every_s=100.0, save_block_s=1.0)
    led = simulate([4] * 13, GAP, LIVE, job, Placement.EARLY)
    assert led.lost["checkpoint_block"] == pytest.approx(4 * 35 * 1.0)
    _adds_up(led)


def test_the_auto_interval_follows_the_losses_seen_and_retrains_less():
    """checkpoint_auto re-chooses Young–Daly after each save and rollback: a restart
    launcher losing a node every 10 minutes ends on an interval far below 600 s, and
    retrains less than with the fixed 600 s, the saves' copies included."""
    counts = [4, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3]
    fixed = JobShape(min_nodes=1, max_nodes=4, checkpoint_every_s=600.0, save_block_s=0.5,
                     save_write_s=2.0)
    auto = JobShape(**{**fixed.__dict__, "checkpoint_auto": True})
    a = simulate(counts, GAP, RESTART, auto, Placement.MIDDLE)
    f = simulate(counts, GAP, RESTART, fixed, Placement.MIDDLE)
    assert a.events["auto_interval_s"] < 300
    assert a.lost["retrained"] + a.lost["checkpoint_block"] < f.lost["retrained"] + f.lost.get(
        "checkpoint_block", 0.0)
    _adds_up(a)


def test_the_first_step_clock_starts_at_the_earliest_row_of_the_trace(tmp_path):
    """--clock first-step: the replay's t0 is the earliest step any worker wrote, whatever
    order the ranks appended their rows in (a torn last line is skipped)."""
    from benchmarks.common import Cluster
    from benchmarks.spotbench.live import first_step_time

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"step": 0, "rank": 1, "time": 12.5}\n{"step": 0, "rank": 0, "time": 12.25}\n'
                     '{"step": 1, "ra')
    assert first_step_time(trace, Cluster(tmp_path), timeout_s=5.0) == 12.25


def test_no_first_step_in_time_fails_naming_where_the_logs_are(tmp_path):
    """A job that trains no step before the deadline fails the replay with an error that
    points at the launchers' logs, instead of playing the trace on no job."""
    from benchmarks.common import Cluster
    from benchmarks.spotbench.live import first_step_time

    with pytest.raises(TimeoutError, match="no step trained within 0 s.*logs"):
        first_step_time(tmp_path / "trace.jsonl", Cluster(tmp_path), timeout_s=0.0)
