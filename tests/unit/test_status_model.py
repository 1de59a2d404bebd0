"""Unit tests of status derivation: key parsing, job state, degradation and exit codes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticd.etcd.client import KV
from elasticd.keys import JobKeys
from elasticd.records import (
    Beat,
    CheckpointPointer,
    Event,
    NodeRecord,
    Progress,
    RoundState,
    StopMark,
)
from elasticd.status.model import (
    EXIT_DEGRADED,
    EXIT_NOT_TRAINING,
    EXIT_OK,
    derive_status,
    format_age,
    status_line,
)
from elasticd.status.snapshot import JobSnapshot, SeqEvent, parse_all_kvs, parse_job_kvs

NOW = 1_750_000_000.0
K = JobKeys("demo")


def node(name: str, *, state: str = "training", round_: int = 5, rank0: int = 0,
         **kw) -> NodeRecord:
    return NodeRecord(node=name, host=f"{name}.example", pid=100, version="0.1.0",
                      started_at=NOW - 600, state=state, round=round_,
                      ranks=[rank0, rank0 + 1], heartbeat_at=NOW - 1, local_world_size=2, **kw)


def ev(seq: int, kind: str, node_: str = "a", *, age_s: float = 1000.0, **detail) -> SeqEvent:
    return SeqEvent(seq, Event(time=NOW - age_s, kind=kind, node=node_, round=5,
                               message=f"{kind} {node_}", detail=detail))


def snap(members=("a", "b"), *, live=None, phase="final", max_nodes=2, min_nodes=1,
         events=(), closed=False, joins=None, progress=None) -> JobSnapshot:
    live = [node(m, rank0=2 * i) for i, m in enumerate(members)] if live is None else live
    rs = RoundState(round=5, phase=phase, members=list(members), min_nodes=min_nodes,
                    max_nodes=max_nodes, opened_at=NOW - 100, completed_at=NOW - 90)
    return JobSnapshot(job="demo", revision=42, round_state=rs, closed=closed, nodes=tuple(live),
                       events=tuple(events), joins=joins or {}, progress=progress)


def kv(key: str, value: str | bytes) -> KV:
    return KV(key, value.encode() if isinstance(value, str) else value, 1, 1, 0)


# -- parsing -----------------------------------------------------------------------------
def test_parse_decodes_records_and_skips_store_keys():
    """Records decode by key; store keys are skipped and joins/failures counted per round."""
    rs = RoundState(round=5, phase="final", members=["a"], max_nodes=1)
    kvs = [
        kv(K.rdzv_state, rs.to_json()),
        kv(K.node("a"), node("a").to_json()),
        kv(K.progress, Progress(round=5, step=10).to_json()),
        kv(K.checkpoint_latest, CheckpointPointer(step=8, round=5, manifest_url="file:///c",
                                                  committed_at=NOW).to_json()),
        kv(K.event(2), ev(2, "join").event.to_json()),
        kv(K.event(1), ev(1, "round").event.to_json()),
        kv(K.join(5, "a"), "not json at all"),
        kv(K.join(6, "c"), "{}"),
        kv(K.join(6, "d"), "{}"),
        kv(K.failure(5, "a"), "{}"),
        kv(f"{K.store_prefix(5)}some/key", b"\x00\xff binary"),
        kv(K.rdzv_closed, "1"),
        kv(f"{K.prefix}future/key", "ignored"),
        kv(K.left(5, "b"), "drained"),
        kv(K.left(5, "c"), "\x1b[2Jhostile"),
        kv(K.beat("a"), Beat(at=NOW, round=5, step=9).to_json()),
        kv(K.beat("b"), "[]"),
        kv(K.stop_mark, StopMark(requested_at=NOW, by="ops").to_json()),
        kv(K.drain_mark("c"), StopMark(requested_at=NOW).to_json()),
    ]
    s = parse_job_kvs("demo", kvs, 42)
    assert s.round_state == rs and s.closed and s.revision == 42
    assert [n.node for n in s.nodes] == ["a"]
    assert s.progress.step == 10 and s.checkpoint.step == 8
    assert [e.seq for e in s.events] == [1, 2]
    assert s.joins == {5: 1, 6: 2} and s.failures == {5: ("a",)}
    assert s.left == {5: {"b": "drained", "c": "left"}}  # an unknown kind is never shown
    assert s.beats == {"a": Beat(at=NOW, round=5, step=9)}
    assert s.stop_mark == StopMark(requested_at=NOW, by="ops") and s.drain_marks == ("c",)
    assert s.unreadable == (K.beat("b"),)


def test_parse_collects_unreadable_records_instead_of_failing():
    """A corrupt record is reported by key and the rest of the job still decodes."""
    s = parse_job_kvs("demo", [kv(K.node("a"), "{oops"), kv(K.node("b"), node("b").to_json())], 1)
    assert s.unreadable == (K.node("a"),)
    assert [n.node for n in s.nodes] == ["b"]


def test_parse_all_groups_by_job_and_ignores_other_jobs_keys():
    """The job list splits one range read into one snapshot per job, by name."""
    other = JobKeys("other")
    kvs = [kv(K.progress, Progress(round=1, step=1).to_json()),
           kv(f"{other.store_prefix(1)}x", "y"),
           kv(other.progress, Progress(round=1, step=2).to_json())]
    snaps = parse_all_kvs(kvs, 9)
    assert [(s.job, s.progress.step) for s in snaps] == [("demo", 1), ("other", 2)]


# -- state rules -------------------------------------------------------------------------
def test_full_round_all_training_is_training_exit_0():
    """Final round, every member live and training, max size, no failures: exit 0."""
    st = derive_status(snap(), NOW)
    assert (st.state, st.degraded, st.exit_code) == ("training", False, EXIT_OK)
    assert st.world_size == 4 and st.nodes_in_round == 2


def test_below_max_nodes_is_degraded_exit_1():
    """Training with fewer members than max_nodes is degraded."""
    st = derive_status(snap(max_nodes=4), NOW)
    assert st.state == "training" and st.exit_code == EXIT_DEGRADED
    assert st.degraded_reasons == ("2 of max 4 nodes",)


@pytest.mark.parametrize("kind", ["failure", "lost", "hang", "lease_lost"])
def test_health_is_about_now_and_a_recovery_is_information(kind):
    """At full size a job is healthy (exit 0) right after a recovery; the recovery is
    reported (recovered_at, what from) within --window and not after it."""
    fresh = derive_status(snap(events=[ev(1, kind, age_s=95)]), NOW, window_s=300)
    assert (fresh.state, fresh.exit_code, fresh.degraded) == ("training", EXIT_OK, False)
    assert fresh.recovered_at == NOW - 90 and kind in fresh.recovered_from
    old = derive_status(snap(events=[ev(1, kind, age_s=95)]), NOW + 211, window_s=300)
    assert old.exit_code == EXIT_OK and old.recovered_at is None
    # A fault after the round formed is not a recovery of this round.
    after = derive_status(snap(events=[ev(1, kind, age_s=5)]), NOW)
    assert after.recovered_at is None
    # The recovery is the first round after the fault, not a later join's round.
    joined = derive_status(snap(events=[ev(1, kind, age_s=300), ev(2, "round", age_s=290),
                                        ev(3, "join", age_s=95), ev(4, "round", age_s=90)]), NOW)
    assert joined.recovered_at == NOW - 290 and joined.exit_code == EXIT_OK


def test_benign_recent_events_do_not_degrade():
    """Joins, rounds, restarts and notices are not failures."""
    events = [ev(i, k, age_s=5) for i, k in enumerate(["join", "round", "restart", "notice"])]
    assert derive_status(snap(events=events), NOW).exit_code == EXIT_OK


def test_lost_member_is_re_forming_with_lost_row():
    """A member without a live record and no clean leave is lost: the job is re-forming
    (degraded, exit 1) and the row carries its lost time."""
    st = derive_status(snap(live=[node("a")], events=[ev(7, "lost", "b", age_s=12)]), NOW)
    assert st.state == "re-forming" and st.exit_code == EXIT_DEGRADED and st.degraded
    assert "lost: b" in st.reason
    row = {n.node: n for n in st.nodes}["b"]
    assert row.state == "lost" and row.member and row.lost_at == NOW - 12


def test_member_that_left_cleanly_is_left_not_lost():
    """A member with a clean-leave marker in the round is "left" (with how), never "lost"."""
    st = derive_status(replace(snap(live=[node("a")]), left={5: {"b": "drained"}}), NOW)
    row = {n.node: n for n in st.nodes}["b"]
    assert (row.state, row.left) == ("left", "drained")
    assert st.state == "re-forming" and "left: b" in st.reason
    # Every node left after a Ctrl-C: stopped, and no row says lost.
    gone = derive_status(replace(snap(live=[]), left={5: {"a": "drained", "b": "drained"}}), NOW)
    assert gone.state == "stopped" and {n.state for n in gone.nodes} == {"left"}
    # A leave recorded for an older round does not excuse this round's member.
    older = derive_status(replace(snap(live=[node("a")]), left={4: {"b": "drained"}}), NOW)
    assert {n.node: n.state for n in older.nodes}["b"] == "lost"


def test_failed_workers_reported_in_the_round_mean_re_forming():
    """While a dead peer's lease still runs, the survivors' failure reports show the job
    re-forming, not training."""
    st = derive_status(replace(snap(), failures={5: ("a",), 4: ("b",)}), NOW)
    assert st.state == "re-forming" and st.exit_code == EXIT_DEGRADED
    assert "a" in st.reason and "reported failed workers" in st.reason
    stale = derive_status(replace(snap(), failures={4: ("a",)}), NOW)
    assert stale.state == "training"


def test_step_is_the_newest_of_progress_beats_and_checkpoint():
    """progress.step is never older than a node's beat or the checkpoint of the same round."""
    base = snap(progress=Progress(round=5, step=10, epoch=1, updated_at=NOW - 4))
    beats = {"a": Beat(at=NOW - 1, round=5, step=13), "b": Beat(at=NOW - 2, round=4, step=99)}
    st = derive_status(replace(base, beats=beats), NOW)
    assert (st.progress.step, st.progress.epoch, st.progress.updated_at) == (13, 1, NOW - 1)
    ckpt = CheckpointPointer(step=20, round=5, manifest_url="file:///m", committed_at=NOW - 3)
    assert derive_status(replace(base, checkpoint=ckpt), NOW).progress.step == 20
    old_round = replace(ckpt, round=4, step=50)
    assert derive_status(replace(base, checkpoint=old_round), NOW).progress.step == 10


def test_node_beat_gives_heartbeat_age_step_and_local_world_size():
    """A node's beat, not its record's last rewrite, dates its heartbeat; its step and
    local world size in the same round are shown."""
    rec = replace(node("a"), heartbeat_at=NOW - 600, local_world_size=0)
    beats = {"a": Beat(at=NOW - 2, round=5, step=7, local_world_size=2)}
    st = derive_status(replace(snap(members=("a",), live=[rec], max_nodes=1), beats=beats), NOW)
    row = st.nodes[0]
    assert (row.heartbeat_at, row.step, row.local_world_size) == (NOW - 2, 7, 2)


def test_open_round_is_rendezvous():
    """An open round means rendezvous, with joined count and bounds in the reason."""
    st = derive_status(snap(members=("a",), phase="open", min_nodes=2, max_nodes=4,
                            joins={5: 1}), NOW)
    assert st.state == "rendezvous" and "1 joined, needs 2..4" in st.reason


def test_member_restarting_or_behind_is_rendezvous():
    """A member restarting, or still in an older round, means the group is not training."""
    restarting = derive_status(snap(live=[node("a"), node("b", state="restarting", rank0=2)]), NOW)
    behind = derive_status(snap(live=[node("a"), node("b", round_=4, rank0=2)]), NOW)
    assert restarting.state == behind.state == "rendezvous"
    assert "b restarting" in restarting.reason and "round 4" in behind.reason


def test_member_re_forming_in_place_is_never_healthy():
    """A member whose agent ordered its live workers into this round, and which they have
    not all confirmed, makes the job re-forming (exit 1), never training at full size: its
    workers may still train alone in the old round (issue 26)."""
    st = derive_status(snap(live=[node("a"), node("b", state="re-forming", rank0=2)]), NOW)
    assert (st.state, st.exit_code) == ("re-forming", EXIT_DEGRADED)
    assert "1 node(s) re-forming in place (b)" in st.reason and st.degraded
    assert [n.state for n in st.nodes] == ["training", "re-forming"]


def test_no_round_state_is_rendezvous():
    """Agents alive but no round formed yet: rendezvous."""
    s = replace(snap(), round_state=None)
    st = derive_status(s, NOW)
    assert st.state == "rendezvous" and st.round is None and st.exit_code == EXIT_NOT_TRAINING


def test_draining_node_is_draining_exit_1():
    """A node draining (graceful leave) keeps training until the step boundary: degraded."""
    st = derive_status(snap(live=[node("a", state="draining"), node("b", rank0=2)]), NOW)
    assert st.state == "draining" and st.exit_code == EXIT_DEGRADED
    assert "a" in st.reason and st.degraded


def test_closed_after_finish_is_stopped_and_after_failure_is_failed():
    """A closed rendezvous is stopped when the job finished, failed when a failure came last."""
    finished = derive_status(snap(closed=True, events=[ev(1, "failure"), ev(2, "finished")]), NOW)
    failed = derive_status(snap(closed=True, events=[ev(1, "finished"),
                                                     ev(2, "failure", signal="SIGKILL")]), NOW)
    assert (finished.state, finished.exit_code) == ("stopped", EXIT_NOT_TRAINING)
    assert (failed.state, failed.exit_code) == ("failed", EXIT_NOT_TRAINING)
    assert "signal SIGKILL" in failed.reason


def test_failed_node_record_means_failed():
    """A live record in state failed (restart budget spent) makes the job failed."""
    st = derive_status(snap(live=[node("a", state="failed", last_exit="exit 3"),
                                  node("b", rank0=2)]), NOW)
    assert st.state == "failed" and "exit 3" in st.reason


def test_no_live_nodes_is_stopped_with_last_event_in_reason():
    """With every lease gone the job is stopped, and the reason names the last event."""
    st = derive_status(snap(live=[], events=[ev(1, "lost", "b", age_s=30)]), NOW)
    assert st.state == "stopped" and "lost of b" in st.reason
    done = derive_status(snap(live=[], events=[ev(1, "finished", age_s=30)]), NOW)
    assert "finished" in done.reason


def test_waiting_joiners_are_counted_for_later_rounds_only():
    """Join keys for rounds after the current one count as waiting nodes."""
    st = derive_status(snap(joins={4: 3, 5: 2, 6: 1, 7: 2}), NOW)
    assert st.waiting_nodes == 3


def test_world_size_falls_back_to_progress_when_a_member_is_lost():
    """A lost member's ranks are only known from the progress record of the same round."""
    st = derive_status(snap(live=[node("a")], progress=Progress(round=5, step=1, world_size=4)), NOW)
    assert st.world_size == 4


def test_node_rows_follow_rank_order_then_non_members():
    """Members appear in round order (lost ones in their slot), then other agents by name."""
    live = [node("z", rank0=0), node("b", rank0=4), node("spare", state="joining", round_=-1)]
    st = derive_status(snap(members=("z", "a", "b"), live=live, max_nodes=3), NOW)
    assert [(n.node, n.state) for n in st.nodes] == [
        ("z", "training"), ("a", "lost"), ("b", "training"), ("spare", "joining")]


def test_events_limit_keeps_newest_oldest_first():
    """--events N keeps the newest N events, in time order."""
    st = derive_status(snap(events=[ev(i, "join") for i in range(20)]), NOW, events_limit=3)
    assert [e.seq for e in st.events] == [17, 18, 19]
    assert derive_status(snap(events=[ev(1, "join")]), NOW, events_limit=0).events == ()


def test_status_line_says_why():
    """The stderr line names the job, the state and the reason."""
    assert status_line(derive_status(snap(max_nodes=3), NOW)) == \
        "job demo degraded: 2 of max 3 nodes"
    line = status_line(derive_status(snap(phase="open"), NOW))
    assert line.startswith("job demo not training: rendezvous (round 5 open")


@pytest.mark.parametrize("seconds,text", [(-3, "0s"), (4.9, "4s"), (192, "3m12s"),
                                          (7500, "2h05m"), (273600, "3d04h")])
def test_format_age(seconds, text):
    """Ages are compact and never negative."""
    assert format_age(seconds) == text


class _WeirdClient:
    def endpoint_label(self) -> str:
        return "127.0.0.1:9"

    def get_prefix(self, prefix):
        raise RuntimeError("Received http2 header with status: 404\n  more")


def test_unexpected_read_errors_become_etcd_unavailable():
    """A non-etcd server on the port ends as 'etcd unreachable' (exit 4), in one line."""
    from elasticd.errors import EtcdUnavailableError
    from elasticd.status.snapshot import read_prefix

    with pytest.raises(EtcdUnavailableError, match="did not answer as etcd") as exc:
        read_prefix(_WeirdClient(), "/elasticd/")  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)


def test_agent_event_keys_with_node_suffix_are_parsed_in_order():
    """Events keyed events/<µs>-<node> (as the agent writes them) decode and sort by time."""
    kvs = [kv(f"{K.event(1_750_000_000_000_002)}-b", ev(2, "join", "b").event.to_json()),
           kv(f"{K.event(1_750_000_000_000_001)}-a", ev(1, "failure", "a").event.to_json()),
           kv(f"{K.events_prefix}garbage", "{}")]
    s = parse_job_kvs("demo", kvs, 1)
    assert [(e.seq, e.event.node) for e in s.events] == [(1_750_000_000_000_001, "a"),
                                                         (1_750_000_000_000_002, "b")]


def test_all_agents_stopped_is_stopped():
    """Agents that finished (state stopped) but still hold their lease mean stopped, not rendezvous."""
    live = [node("a", state="stopped"), node("b", state="stopped", rank0=2)]
    st = derive_status(snap(live=live), NOW)
    assert st.state == "stopped" and st.reason == "all 2 agent(s) stopped"


@pytest.mark.parametrize("detail,text", [({"exit_code": 1}, "exit 1"),
                                         ({"exit_code": -9}, "signal SIGKILL"),
                                         ({"signal": "SIGTERM"}, "signal SIGTERM"),
                                         ({}, "")])
def test_exit_detail_reads_torch_negative_codes_as_signals(detail, text):
    """torch reports death by signal as a negative exit code."""
    from elasticd.status.model import exit_detail

    assert exit_detail(detail) == text


def test_operator_stop_and_drain_marks_are_named():
    """A job stopped with `elasticd stop` says so and how to start it again; a node kept out
    by `elasticd drain` is named among the reasons a job is below max size."""
    stopped = derive_status(replace(snap(live=[]), stop_mark=StopMark(requested_at=NOW - 60,
                                                                       by="ops@host")), NOW)
    assert stopped.state == "stopped" and "elasticd stop` by ops@host 1m00s ago" in stopped.reason
    assert "elasticd start --job demo" in stopped.reason
    small = derive_status(replace(snap(max_nodes=3), drain_marks=("c",)), NOW)
    assert small.exit_code == EXIT_DEGRADED
    assert small.degraded_reasons == ("2 of max 3 nodes", "kept out by `elasticd drain`: c")


def test_members_sent_off_by_stop_or_drain_are_left_not_lost():
    """After `elasticd stop` (or `drain --node`), a gone member whose leave record went with
    a superseded round reads "left", not "lost"; one lost after the stop still reads lost."""
    stop = StopMark(requested_at=NOW - 60, by="ops")
    rows = {n.node: (n.state, n.left) for n in derive_status(
        replace(snap(live=[]), stop_mark=stop), NOW).nodes}
    assert rows == {"a": ("left", "drained"), "b": ("left", "drained")}
    lost_after = snap(live=[], events=[ev(1, "lost", "b", age_s=30)])
    rows = {n.node: n.state for n in derive_status(replace(lost_after, stop_mark=stop), NOW).nodes}
    assert rows == {"a": "left", "b": "lost"}
    drained = derive_status(replace(snap(live=[node("a")]), drain_marks=("b",)), NOW)
    assert {n.node: n.state for n in drained.nodes}["b"] == "left"
    assert {n.node: n.state for n in derive_status(snap(live=[node("a")]), NOW).nodes}["b"] == "lost"


def test_the_cause_of_the_round_is_shown():
    """A round opened by the coordinator for a lost member says so, with the node."""
    s = snap()
    s = replace(s, round_state=replace(s.round_state, cause="member_lost", changed=["c"]))
    st = derive_status(s, NOW)
    assert (st.round_cause, st.round_changed) == ("member_lost", ("c",))
    assert derive_status(snap(), NOW).round_cause is None
