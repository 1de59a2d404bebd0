"""Which node is a straggler (pure policy over the members' own step times)."""

from __future__ import annotations

from elasticd.rendezvous.stragglers import (
    BusyShare,
    StragglerWatch,
    find_stragglers,
    pick_ejection,
    probation_s,
    shrink_pays,
)


def _series(value: float, start: float = 0.0, end: float = 40.0, every: float = 1.0):
    t, out = start, []
    while t <= end:
        out.append((t, value))
        t += every
    return out


def test_a_node_slower_than_the_median_for_the_whole_window_is_flagged() -> None:
    """1.5x the median for 40 s against a 30 s window: flagged, with its ratio."""
    v = find_stragglers({"a": _series(0.1), "b": _series(0.1), "c": _series(0.15)},
                        now=40.0, factor=1.25, window_s=30.0)
    assert dict(v.flagged) == {"c": 1.5} and "c 1.50x" in v.reason


def test_not_before_the_window_is_covered_nor_unless_four_looks_in_five_are_slow() -> None:
    """Slow for 20 s only: the window is not covered. One fast look inside a slow window
    does not reset it (4 in 5 is persistent), but fast on more than a fifth of the looks,
    or on the newest one, is not; a node slow since its start is flagged about 24 s in."""
    short = {"a": _series(0.1, 20), "b": _series(0.1, 20), "c": _series(0.15, 20)}
    assert not find_stragglers(short, now=40.0).flagged
    healthy = {"a": _series(0.1), "b": _series(0.1)}
    blip = _series(0.15)
    blip[30] = (30.0, 0.1)
    assert dict(find_stragglers({**healthy, "c": blip}, now=40.0).flagged) == {"c": 1.5}
    noisy = [(t, 0.1 if int(t) % 4 == 0 else 0.15) for t, _ in _series(0.15)]  # 1 in 4 fast
    assert not find_stragglers({**healthy, "c": noisy}, now=40.0).flagged
    recovered = _series(0.15)
    recovered[-1] = (40.0, 0.1)
    assert not find_stragglers({**healthy, "c": recovered}, now=40.0).flagged
    onset = _series(0.1, 0, 15) + _series(0.15, 16, 40)  # slow from 16 s on
    firsts = [now for now in range(31, 41)
              if find_stragglers({**healthy, "c": onset}, now=float(now)).flagged]
    assert firsts[0] == 40  # at 40 s, 25 of the 31 looks of the last 30 s are slow (>= 80 %)


def test_slightly_slow_or_two_nodes_flag_nobody() -> None:
    """1.2x is under the 1.25 default; with two members the median is no reference."""
    assert not find_stragglers({"a": _series(0.1), "b": _series(0.1), "c": _series(0.12)},
                               now=40.0).flagged
    assert not find_stragglers({"a": _series(0.1), "c": _series(0.3)}, now=40.0).flagged


def test_everyone_slow_together_flags_nobody() -> None:
    """The whole job slower (a slow epoch, a checkpoint): the median moves with it."""
    s = _series(0.1, 0, 20) + _series(0.3, 21, 40)
    assert not find_stragglers({"a": s, "b": s, "c": s}, now=40.0).flagged


def test_shrink_pays_only_when_n_minus_1_over_the_rest_beats_n_over_the_slowest() -> None:
    """3 nodes, one 1.5x slower: 2/0.1 = 20 beats 3/0.15 = 20? no (equal); 2x: yes.
    Never below min_nodes."""
    assert not shrink_pays({"a": 0.1, "b": 0.1, "c": 0.15}, "c", min_nodes=1)
    assert shrink_pays({"a": 0.1, "b": 0.1, "c": 0.2}, "c", min_nodes=1)
    assert not shrink_pays({"a": 0.1, "b": 0.1, "c": 0.2}, "c", min_nodes=3)
    assert shrink_pays({n: 0.1 for n in "abcdefg"} | {"h": 0.13}, "h", min_nodes=1)
    assert not shrink_pays({"a": 0.1, "b": 0.1}, "x", min_nodes=1)


def test_busy_share_is_the_share_of_looks_the_workers_were_not_waiting() -> None:
    """S is waiting; R (running), T (stopped) and D (I/O) hold the step up."""
    b = BusyShare(window_s=10.0)
    assert b.share() == 0.0
    for i, states in enumerate((["S"], ["R"], ["T"], ["S", "R"], ["S", "S"])):
        b.observe(states, float(i))
    assert b.share() == 3 / 5
    b.observe([], 6.0)  # no worker: forget
    assert b.share() == 0.0


def test_the_watch_flags_and_clears_on_its_own_clock_per_round() -> None:
    """Fed once a second, the watch flags after the window and forgets on a new round."""
    w = StragglerWatch(factor=1.25, window_s=10.0)
    members = ["a", "b", "c"]
    verdict = None
    for t in range(15):
        verdict = w.observe(1, members, {"a": 0.1, "b": 0.1, "c": 0.2}, float(t))
    assert verdict is not None and set(verdict.flagged) == {"c"} and w.flagged == {"c"}
    assert not w.observe(2, members, {"a": 0.1, "b": 0.1, "c": 0.2}, 15.0).flagged


def test_pick_ejection_takes_the_slowest_flagged_only_when_the_shrink_pays():
    """The slowest flagged node, only when N-1 nodes beat N (shrink_pays), never below
    min_nodes, never to a size the job cannot run at."""
    own = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 1.1}
    anysize = lambda n: True  # noqa: E731
    node, why = pick_ejection({"c": 2.0, "d": 1.3}, own, min_nodes=1, size_ok=anysize)
    assert node == "c" and "2.00x" in why and "3 nodes" in why
    assert pick_ejection({}, own, min_nodes=1, size_ok=anysize) is None
    # 4 nodes at 1.3 s vs 3 at 1.1 s: 3/1.1 = 2.73 < 4/1.3 = 3.08: keep it.
    assert pick_ejection({"c": 1.3}, {**own, "c": 1.3}, min_nodes=1, size_ok=anysize) is None
    assert pick_ejection({"c": 2.0}, own, min_nodes=4, size_ok=anysize) is None
    assert pick_ejection({"c": 2.0}, own, min_nodes=1, size_ok=lambda n: n % 2 == 0) is None
    assert pick_ejection({"x": 2.0}, own, min_nodes=1, size_ok=anysize) is None


def test_probation_doubles_per_ejection_up_to_8x():
    assert [probation_s(60, k) for k in (1, 2, 3, 4, 5, 9)] == [60, 120, 240, 480, 480, 480]
    assert probation_s(60, 0) == 60


def test_the_watch_reports_each_members_newest_own_step_time():
    w = StragglerWatch(window_s=5)
    w.observe(1, ["a", "b"], {"a": 1.0, "b": 2.0}, now=0.0)
    w.observe(1, ["a", "b"], {"a": 1.5, "b": 0.0}, now=1.0)
    assert w.latest() == {"a": 1.5, "b": 2.0}
    w.observe(2, ["a"], {}, now=2.0)
    assert w.latest() == {}


def test_the_drain_bound_is_ten_steps_within_5_and_120_s():
    from elasticd.rendezvous.stragglers import drain_bound_s

    assert drain_bound_s(0.0) == 5.0  # unknown step time
    assert drain_bound_s(0.2) == 5.0
    assert drain_bound_s(1.5) == 15.0
    assert drain_bound_s(60.0) == 120.0


def test_the_trial_window_is_a_third_of_the_window_but_never_under_two_busy_windows():
    """30 s -> 10 s; 60 s -> 20 s; a short window is its own trial (5 s -> 5 s)."""
    from elasticd.rendezvous.stragglers import trial_window_s

    assert trial_window_s(30.0) == 10.0
    assert trial_window_s(60.0) == 20.0
    assert trial_window_s(12.0) == 10.0
    assert trial_window_s(5.0) == 5.0


def test_a_readmitted_straggler_still_slow_is_flagged_on_the_trial_window():
    """Ejected once and back, still 2x slow: flagged after the 10 s trial window (4 in 5
    looks), where a node never ejected needs the 30 s window; the reason says so."""
    fresh, tried = StragglerWatch(window_s=30.0), StragglerWatch(window_s=30.0)
    tried.put_on_trial("c")
    members = ["a", "b", "c"]
    own = {"a": 0.1, "b": 0.1, "c": 0.2}
    first = {}
    for t in range(40):
        for name, w in (("fresh", fresh), ("tried", tried)):
            if w.observe(5, members, own, float(t)).flagged and name not in first:
                first[name] = t
    assert first == {"tried": 11, "fresh": 31}, first
    again = StragglerWatch(window_s=30.0)
    again.put_on_trial("c")
    verdict = None
    for t in range(12):
        verdict = again.observe(5, members, own, float(t))
    assert verdict is not None and "on trial: 10s" in verdict.reason


def test_a_trial_passes_after_a_whole_window_at_speed_and_restarts_with_a_new_round():
    """A re-admitted node that trains at the median for a whole window, counted from one
    busy-share window (5 s) after its first look in the round, leaves the trial (reported
    once in ``trials_passed``) and is judged on the full window after; a new round before
    that restarts its trial, and so does one slow look."""
    w = StragglerWatch(window_s=30.0)
    w.put_on_trial("c")
    members = ["a", "b", "c"]
    healthy = {"a": 0.1, "b": 0.1, "c": 0.1}
    for t in range(20):
        assert not w.observe(1, members, healthy, float(t)).trials_passed
    w.observe(2, members, healthy, 20.0)  # a new round: the trial starts again
    passed = [t for t in range(21, 60) if w.observe(2, members, healthy, float(t)).trials_passed]
    assert passed == [55] and "c" not in w.on_trial
    blip = StragglerWatch(window_s=30.0)
    blip.put_on_trial("c")
    looks = {t: healthy if t != 20 else {"a": 0.1, "b": 0.1, "c": 0.3} for t in range(60)}
    assert [t for t in range(60) if blip.observe(1, members, looks[t], float(t)).trials_passed] == [50]
    # Slow again after the trial: the whole window is needed once more.
    slow = {"a": 0.1, "b": 0.1, "c": 0.2}
    flagged = [t for t in range(60, 100) if w.observe(2, members, slow, float(t)).flagged]
    assert flagged and flagged[0] >= 60 + 24, flagged


def test_a_trial_does_not_pass_on_the_looks_of_the_first_busy_share_window():
    """A short window (5 s, the busy-share window's length): for the first 5 s after the
    admission the others' busy shares still average the time they trained without the
    node, so a still-slow node looks at speed. Those looks do not pass its trial; it is
    flagged on trial once the looks show it slow (before this, it passed at t=5)."""
    w = StragglerWatch(window_s=5.0)
    w.put_on_trial("c")
    members = ["a", "b", "c"]
    looks = [{"a": 0.2, "b": 0.2, "c": 0.21} if t < 6 else {"a": 0.1, "b": 0.1, "c": 0.4}
             for t in range(20)]
    verdicts = [w.observe(1, members, looks[t], float(t)) for t in range(20)]
    assert not any(v.trials_passed for v in verdicts)
    flagged = [t for t, v in enumerate(verdicts) if v.flagged]
    assert flagged and "on trial: 5s" in verdicts[flagged[0]].reason, flagged


def test_a_flagged_node_on_trial_does_not_pass_it():
    """Slow through its trial: it stays on trial (flagged), never reported as passed."""
    w = StragglerWatch(window_s=30.0)
    w.put_on_trial("c")
    members = ["a", "b", "c"]
    verdicts = [w.observe(1, members, {"a": 0.1, "b": 0.1, "c": 0.3}, float(t)) for t in range(45)]
    assert not any(v.trials_passed for v in verdicts)
    assert "c" in w.on_trial and verdicts[-1].flagged
