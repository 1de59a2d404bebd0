"""Unit tests of the agent's pure restart policy (elasticd.agent.policy.decide).

The drain-on-join (resize) tests walk one node through a scale-up: nodes join, the workers
are asked to stop, a peer may re-form first, the workers exit, the job re-forms.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticd.agent.policy import (
    REGISTRATION_FACTOR,
    REGISTRATION_SLACK_S,
    Facts,
    GroupState,
    Verdict,
    decide,
    may_still_register,
)
from elasticd.rendezvous.protocol import Attribution, MembershipChange

HEALTHY = Facts(group_state=GroupState.HEALTHY, remaining_restarts=3, any_progress=True)
JOIN = replace(HEALTHY, nodes_waiting=1, membership=MembershipChange.JOIN,
               membership_reason="nodes waiting to join: n2", workers_drainable=True)
RESIZING = replace(HEALTHY, resizing=True, workers_drainable=True)  # a resize needs drainable workers


def test_healthy_with_nobody_waiting_continues():
    """Healthy workers and no membership change: keep monitoring."""
    assert decide(HEALTHY).verdict is Verdict.CONTINUE


def test_join_with_drainable_workers_starts_a_resize():
    """Only newcomers wait and the workers call should_stop: ask them to stop, naming the joiner."""
    d = decide(JOIN)
    assert d.verdict is Verdict.START_RESIZE
    assert "n2" in d.reason and "next step" in d.reason


@pytest.mark.parametrize("change", [
    {"workers_drainable": False},  # a plain torchrun script never calls should_stop
    {"resize_enabled": False},  # resize_grace_s = 0
    {"membership": "member_lost", "membership_reason": "members lost: n1"},
    {"membership": "newer_round", "membership_reason": "round 3 opened while we are in round 2"},
])
def test_other_membership_changes_restart_at_once(change):
    """Anything but a join of drainable workers (with resize on) restarts now, as before."""
    d = decide(replace(JOIN, **change))
    assert d.verdict is Verdict.RESTART_MEMBERSHIP
    assert d.reason.startswith("membership changed")


def test_newer_round_while_our_workers_already_stop_waits_for_them():
    """A peer re-formed first after a resize we had not seen; our workers are saving: wait."""
    f = replace(JOIN, membership=MembershipChange.NEWER_ROUND, membership_reason="round 3 opened",
                stopped_for_drain=True)
    assert decide(f).verdict is Verdict.START_RESIZE


def test_peer_that_drained_and_left_does_not_cut_our_drain_save_short():
    """A peer drained and revoked its lease (a clean leave reads as a lost member) while our
    workers, stopped at the same agreed step, are still saving: wait for them."""
    f = replace(JOIN, membership=MembershipChange.MEMBER_LOST, membership_reason="members lost: n2",
                stopped_for_drain=True)
    assert decide(f).verdict is Verdict.START_RESIZE
    waiting = replace(RESIZING, nodes_waiting=1, membership=MembershipChange.MEMBER_LOST,
                      membership_reason="members lost: n2", stopped_for_drain=True)
    assert decide(waiting).verdict is Verdict.CONTINUE
    assert decide(replace(waiting, resize_deadline_passed=True)).verdict is Verdict.RESTART_MEMBERSHIP


def test_resize_waits_for_workers_while_healthy():
    """While resizing, healthy workers are left to reach the step boundary and save."""
    for f in (RESIZING, replace(RESIZING, nodes_waiting=1, membership=MembershipChange.JOIN)):
        d = decide(f)
        assert d.verdict is Verdict.CONTINUE and "resizing" in d.reason


def test_resize_is_not_cut_short_by_a_peer_opening_the_next_round():
    """A peer's workers finished first and it re-rendezvoused: ours are mid-save, keep waiting."""
    f = replace(RESIZING, nodes_waiting=1, membership=MembershipChange.NEWER_ROUND, membership_reason="round 3 opened")
    assert decide(f).verdict is Verdict.CONTINUE


def test_resize_ends_with_a_membership_restart_when_workers_stopped():
    """Workers exited 0 with stopped markers during a resize: re-form, budget untouched."""
    f = replace(RESIZING, group_state=GroupState.SUCCEEDED, stopped_for_drain=True)
    d = decide(f)
    assert d.verdict is Verdict.RESTART_MEMBERSHIP and "resize" in d.reason


def test_resize_deadline_restarts_hard():
    """Workers that did not stop within resize_grace_s are restarted (today's behaviour)."""
    d = decide(replace(RESIZING, resize_deadline_passed=True, nodes_waiting=1, membership=MembershipChange.NEWER_ROUND))
    assert d.verdict is Verdict.RESTART_MEMBERSHIP and "resize grace period over" in d.reason


def test_member_lost_during_a_resize_restarts_at_once():
    """A lost member overrides the resize, exactly as when no resize runs."""
    f = replace(RESIZING, nodes_waiting=1, membership=MembershipChange.MEMBER_LOST, membership_reason="members lost: n1")
    d = decide(f)
    assert d.verdict is Verdict.RESTART_MEMBERSHIP and "n1" in d.reason


def test_lease_lost_during_a_resize_fences():
    """Our own lease gone beats everything, resize included."""
    assert decide(replace(RESIZING, lease_lost=True)).verdict is Verdict.FENCE


def test_worker_failure_during_a_resize_is_attributed_as_usual():
    """A failure while resizing goes through attribution, not the resize."""
    f = replace(RESIZING, group_state=GroupState.FAILED, attribution=Attribution.MEMBERSHIP)
    assert decide(f).verdict is Verdict.RESTART_MEMBERSHIP
    f = replace(RESIZING, group_state=GroupState.FAILED, attribution=Attribution.ROOT)
    assert decide(f).verdict is Verdict.RESTART_FAILURE
    assert decide(replace(RESIZING, group_state=GroupState.FAILED)).verdict is Verdict.ATTRIBUTE


def test_hang_during_a_resize_is_a_failure():
    """Workers hung while resizing are restarted as a failure (budget spent)."""
    assert decide(replace(RESIZING, hang=True)).verdict is Verdict.RESTART_FAILURE


def test_stop_signal_during_a_resize_becomes_our_drain_and_we_leave():
    """SIGTERM mid-resize starts a drain; once the workers exit the agent leaves, not restarts."""
    assert decide(replace(RESIZING, drain_signals=1)).verdict is Verdict.START_DRAIN
    # The agent clears `resizing` when the drain starts; either way `draining` wins.
    for resizing in (True, False):
        draining = replace(HEALTHY, resizing=resizing, draining=True, drain_signals=1,
                           nodes_waiting=1, membership=MembershipChange.NEWER_ROUND)
        assert decide(draining).verdict is Verdict.CONTINUE
        done = replace(draining, group_state=GroupState.SUCCEEDED, stopped_for_drain=True)
        assert decide(done).verdict is Verdict.LEAVE


def test_draining_node_never_starts_a_resize():
    """A node that is leaving ignores joiners: its drain is already stopping the workers."""
    f = replace(JOIN, draining=True, drain_signals=1)
    assert decide(f).verdict is Verdict.CONTINUE


def test_peer_drain_still_re_forms_and_completion_still_finishes():
    """Stopped markers without a resize: a peer's drain; no markers: the job finished."""
    done = replace(HEALTHY, group_state=GroupState.SUCCEEDED)
    assert decide(replace(done, stopped_for_drain=True)).reason == "workers stopped for a peer's drain"
    assert decide(done).verdict is Verdict.FINISH
    assert decide(replace(done, resizing=True)).verdict is Verdict.FINISH


def test_drain_grace_and_second_signal_stop_hard():
    """The drain's hard stops are unchanged."""
    draining = replace(HEALTHY, draining=True, drain_signals=1)
    assert decide(replace(draining, drain_deadline_passed=True)).verdict is Verdict.HARD_STOP
    assert decide(replace(draining, drain_signals=2)).verdict is Verdict.HARD_STOP


def test_exit_code_2_on_first_start_is_not_retried():
    """Bad arguments before any step: give up instead of spending the budget."""
    f = Facts(group_state=GroupState.FAILED, exit_codes=(2,), remaining_restarts=3)
    assert decide(f).verdict is Verdict.FAIL


# --- teardown (issue 11: items 4, 6, 7) -----------------------------------------------------


def test_stop_signal_with_workers_that_cannot_drain_stops_them_now():
    """Regression: a plain script never called should_stop: a stop signal stops the workers
    at once and leaves, instead of letting them train on for the whole drain grace."""
    d = decide(replace(HEALTHY, drain_signals=1))
    assert d.verdict is Verdict.STOP_NOW and "should_stop" in d.reason
    assert decide(replace(HEALTHY, drain_signals=1, workers_drainable=True)).verdict is Verdict.START_DRAIN


def test_abort_after_every_worker_completed_is_success():
    """Regression: workers that wrote done markers and then died in torch's teardown
    (SIGABRT) finished the job: no restart that would re-run a finished script."""
    f = replace(HEALTHY, group_state=GroupState.FAILED, exit_codes=(-6,), workers_done=True)
    d = decide(f)
    assert d.verdict is Verdict.FINISH and "-6" in d.reason
    assert decide(replace(f, draining=True)).verdict is Verdict.LEAVE
    assert decide(replace(f, stopped_for_drain=True)).verdict is Verdict.RESTART_MEMBERSHIP


def test_workers_done_but_still_running_finish_after_the_bound():
    """Done workers stuck in teardown are waited for done_exit_s, then counted finished."""
    done = replace(HEALTHY, workers_done=True)
    assert decide(done).verdict is Verdict.CONTINUE
    assert decide(replace(done, done_exit_passed=True)).verdict is Verdict.FINISH


def test_failure_without_done_markers_is_still_a_failure():
    """Only completed workers turn an abort into success: without markers it is a failure."""
    f = replace(HEALTHY, group_state=GroupState.FAILED, exit_codes=(-6,), attribution=Attribution.ROOT)
    assert decide(f).verdict is Verdict.RESTART_FAILURE


def test_config_error_exit_78_is_never_retried():
    """Regression: a worker's ConfigError (exit 78) fails the node with 78, at any start,
    with budget left, instead of flapping through restarts."""
    for first_start in (True, False):
        f = replace(HEALTHY, group_state=GroupState.FAILED, exit_codes=(78, 1), first_start=first_start,
                    attribution=Attribution.ROOT, remaining_restarts=3)
        d = decide(f)
        assert (d.verdict, d.exit_code) == (Verdict.FAIL, 78) and "78" in d.reason


def test_peer_that_left_cleanly_is_a_membership_change():
    """A member that drained and left (member_left) re-forms the job without spending budget."""
    f = replace(HEALTHY, nodes_waiting=1, membership=MembershipChange.MEMBER_LEFT, membership_reason="members left: b")
    assert decide(f).verdict is Verdict.RESTART_MEMBERSHIP


def test_facts_carry_enums_not_strings():
    """Every torch WorkerState maps to a GroupState by name (the agent's one conversion)."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    assert [GroupState[s.name].value for s in WorkerState] == [s.name for s in WorkerState]
    assert decide(replace(HEALTHY, group_state=GroupState.INIT)).reason == "worker group INIT"



IMPORT_ERROR = "ModuleNotFoundError: No module named 'nosuchmodule'"
FAILED_AT_START = Facts(group_state=GroupState.FAILED, remaining_restarts=2,
                        attribution=Attribution.ROOT, exit_codes=(1,), first_start=False,
                        failure_line=IMPORT_ERROR, startup_failures=(IMPORT_ERROR,))


def test_a_failure_that_repeats_before_any_step_is_not_retried():
    """Every attempt failed with the same exception line before a step: give up, naming it."""
    d = decide(FAILED_AT_START)
    assert d.verdict is Verdict.FAIL and d.exit_code == 1
    assert "all 2 attempts failed the same way before their first step" in d.reason
    assert d.reason.endswith(IMPORT_ERROR)


@pytest.mark.parametrize("change", [
    {"startup_failures": ()},  # the first failure: one retry proves it repeats
    {"failure_line": "RuntimeError: connection reset"},  # a different failure this time
    {"startup_failures": (IMPORT_ERROR, "OSError: port in use")},  # not every attempt alike
    {"past_startup": True},  # some attempt reported a step or ran STARTUP_S
])
def test_a_failure_that_did_not_repeat_at_start_up_spends_the_budget(change):
    """A first failure, a different one, or one after start-up: restarted as before."""
    assert decide(replace(FAILED_AT_START, **change)).verdict is Verdict.RESTART_FAILURE


def test_an_ejected_node_kills_its_workers_and_rejoins_without_spending_the_budget():
    """The coordinator ejected us (hung): EJECTED, ahead of live re-formation and of the
    restart policy; a stop signal still drains instead."""
    from elasticd.agent.policy import LiveFacts

    f = replace(HEALTHY, ejected="round 4 opened: members hung (ejected): n2", nodes_waiting=1,
                membership=MembershipChange.MEMBER_HUNG, live=LiveFacts(), remaining_restarts=0)
    d = decide(f)
    assert d.verdict is Verdict.EJECTED and "n2" in d.reason
    assert decide(replace(f, drain_signals=1)).verdict is not Verdict.EJECTED
    # The others see the same change as a membership change: re-form live.
    others = replace(f, ejected="")
    assert decide(others).verdict is Verdict.REFORM_LIVE


def test_a_straggler_asked_to_drain_stops_its_workers_at_a_step_then_rejoins_as_a_spare():
    """Put on probation while a member of its round: its workers stop at the next agreed
    step with everyone's (nothing rolled back), then it rejoins; workers that cannot stop
    at a step, a coordinator that gave up waiting, or our own bound: killed, as before."""
    from elasticd.agent.policy import LiveFacts, LivePhase

    why = "on probation for 60s: ejected as a straggler (2.10x the members' median step time)"
    asked = replace(HEALTHY, asked_to_drain=why, workers_drainable=True, live=LiveFacts())
    d = decide(asked)
    assert d.verdict is Verdict.START_EJECT_DRAIN and "2.10x" in d.reason
    assert decide(replace(asked, workers_drainable=False)).verdict is Verdict.EJECTED
    # Not in the middle of a park or a re-formation (its workers wait for an order there).
    parking = replace(asked, live=LiveFacts(phase=LivePhase.PARKING))
    assert decide(parking).verdict is not Verdict.START_EJECT_DRAIN
    # A stop signal is a drain of our own: we leave.
    assert decide(replace(asked, drain_signals=1)).verdict is Verdict.START_DRAIN

    ejecting = replace(HEALTHY, ejecting=True, workers_drainable=True, live=LiveFacts())
    assert decide(ejecting).verdict is Verdict.CONTINUE
    for ended in (GroupState.SUCCEEDED, GroupState.FAILED):
        d = decide(replace(ejecting, group_state=ended))
        assert d.verdict is Verdict.EJECTED and "spare" in d.reason, d
    hard = replace(ejecting, ejected="round 5 opened: stragglers ejected: n2", nodes_waiting=1,
                   membership=MembershipChange.MEMBER_SLOW)
    assert decide(hard).verdict is Verdict.EJECTED
    assert decide(replace(ejecting, eject_deadline_passed=True)).verdict is Verdict.EJECTED
    # A stop signal or a lost lease during it: the restart policy (drain, fence) decides.
    assert decide(replace(ejecting, drain_signals=1)).verdict is Verdict.START_DRAIN
    assert decide(replace(ejecting, lease_lost=True)).verdict is Verdict.FENCE


def test_a_join_waits_while_our_workers_start_for_live_reformation():
    """Spot replay, round 42: a node admitted in the round being re-formed, its workers still
    importing, restarted for the next joiner and opened a round itself; the members fell back
    to the checkpoint. It now waits (its workers park with the members once registered)."""
    starting = replace(JOIN, any_progress=False, workers_drainable=False, live=None,
                       live_starting=True)
    d = decide(starting)
    assert d.verdict is Verdict.CONTINUE and "register" in d.reason
    # Not for a loss (the group cannot form), nor once the bound passed or a step was
    # reported without registering (a script without LiveState): the restart policy acts.
    lost = replace(starting, membership=MembershipChange.MEMBER_LOST, membership_reason="members lost: n1")
    assert decide(lost).verdict is Verdict.RESTART_MEMBERSHIP
    assert decide(replace(starting, live_starting=False)).verdict is Verdict.RESTART_MEMBERSHIP
    # A drain still leaves at once.
    assert decide(replace(starting, drain_signals=1)).verdict in (Verdict.START_DRAIN, Verdict.STOP_NOW)


def test_a_join_into_a_plain_script_is_admitted_at_once_after_the_first_group():
    """Issue 52: a script that never uses the worker API never registers; a join must not
    wait live_reform_timeout_s for it. A later worker group of a node that never saw its
    workers register restarts for the join at once; only the node's first group (its
    workers maybe still importing, the spot replay's case) waits."""
    starting = replace(JOIN, any_progress=False, workers_drainable=False, live=None,
                       live_starting=True, group_age_s=1.0)
    assert decide(replace(starting, first_start=True)).verdict is Verdict.CONTINUE
    later = replace(starting, first_start=False)
    assert decide(later).verdict is Verdict.RESTART_MEMBERSHIP
    assert not may_still_register(later)
    # The first group too, once its workers are known to run a plain script (past their
    # imports without the worker API's marker): it deferred every join of its first 30 s.
    plain = replace(starting, first_start=True, workers_plain=True)
    assert decide(plain).verdict is Verdict.RESTART_MEMBERSHIP
    assert not may_still_register(plain)


def test_a_join_waits_for_registration_only_within_a_window_measured_from_real_ones():
    """A node whose workers registered before (3 s after their start) waits on a join for a
    later group's workers only while they may still register: twice the slowest
    registration seen plus the slack, not live_reform_timeout_s."""
    starting = replace(JOIN, any_progress=False, workers_drainable=False, live=None,
                       live_starting=True, first_start=False, registered_after_s=3.0)
    window = REGISTRATION_FACTOR * 3.0 + REGISTRATION_SLACK_S
    assert decide(replace(starting, group_age_s=window - 0.1)).verdict is Verdict.CONTINUE
    assert decide(replace(starting, group_age_s=window)).verdict is Verdict.RESTART_MEMBERSHIP
    # Measured registrations also bound the node's first group.
    first = replace(starting, first_start=True, group_age_s=window + 1)
    assert decide(first).verdict is Verdict.RESTART_MEMBERSHIP
