"""Valid world sizes (issue 24 item 2): which node counts a round forms at, and who waits
as a spare (pure policy: rendezvous.sizes and the round protocol; the config keys)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.config import load_config
from elasticd.errors import EX_CONFIG, ConfigError
from elasticd.records import RoundState
from elasticd.rendezvous.protocol import (
    ActionKind,
    CoordinatorMemory,
    MembershipChange,
    RendezvousView,
    decide_coordination,
    is_spare,
    nodes_waiting,
    spare_reason,
)
from elasticd.rendezvous.settings import RendezvousSettings
from elasticd.rendezvous.sizes import admitted_size, resolve_valid_sizes

# --- the sizes themselves ------------------------------------------------------------


def test_listed_sizes_are_sorted_and_none_means_every_size() -> None:
    """A list is kept (sorted); nothing declared is () = every size in min..max."""
    assert resolve_valid_sizes([4, 2], 0, 1, min_nodes=1, max_nodes=4) == (2, 4)
    assert resolve_valid_sizes([], 0, 1, min_nodes=1, max_nodes=4) == ()


def test_sizes_derived_from_the_global_batch_count_workers() -> None:
    """Global batch 2: 1 or 2 nodes of 1 worker; with 2 workers a node only 1 node."""
    assert resolve_valid_sizes([], 2, 1, min_nodes=1, max_nodes=3) == (1, 2)
    assert resolve_valid_sizes([], 2, 2, min_nodes=1, max_nodes=3) == (1,)
    assert resolve_valid_sizes([], 12, 1, min_nodes=2, max_nodes=8) == (2, 3, 4, 6)
    # Both declared: a size must be listed and divide the batch.
    assert resolve_valid_sizes([2, 3, 4], 8, 1, min_nodes=1, max_nodes=4) == (2, 4)


@pytest.mark.parametrize(("listed", "batch", "fragment"), [
    ([1, 5], 0, "5 outside job.nnodes = '1:3'"),
    ([3], 2, "none of [3] splits it evenly over 1 worker(s) per node; list node counts "
             "that do (1, 2)"),
    ([], 7, "no node count in 2:3 splits it evenly over 1 worker(s) per node; use a global "
            "batch divisible by 2"),
])
def test_sizes_outside_nnodes_or_none_valid_are_config_errors(listed, batch, fragment) -> None:
    """A size outside min..max, or no valid size at all: a config error saying the fix."""
    lo = 2 if batch == 7 else 1
    with pytest.raises(ConfigError) as info:
        resolve_valid_sizes(listed, batch, 1, min_nodes=lo, max_nodes=3)
    assert fragment in str(info.value) and info.value.exit_code == EX_CONFIG


def test_admitted_size_is_the_largest_valid_size_reached() -> None:
    """3 available of {1,2}: 2; of {2,4}: 2; 1 of {2,4}: none; all sizes: up to max."""
    assert admitted_size(3, (1, 2), min_nodes=1, max_nodes=3) == 2
    assert admitted_size(3, (2, 4), min_nodes=1, max_nodes=4) == 2
    assert admitted_size(1, (2, 4), min_nodes=1, max_nodes=4) == 0
    assert admitted_size(5, (), min_nodes=1, max_nodes=3) == 3
    assert admitted_size(1, (), min_nodes=2, max_nodes=3) == 0


# --- the round protocol with sizes ------------------------------------------------------


def _coordinate(state: RoundState, alive: set[str], joins: dict[int, list[str]],
                valid: tuple[int, ...], *, min_nodes: int = 1, max_nodes: int = 3,
                now: float = 100.0):
    view = RendezvousView(state, frozenset(alive), joins, coordinator="a")
    memory = CoordinatorMemory(min_reached_at={state.round: 0.0})
    return decide_coordination(view, memory, me="a", min_nodes=min_nodes, max_nodes=max_nodes,
                               last_call_timeout_s=1.0, now=now, valid_sizes=valid)


def test_three_nodes_of_valid_sizes_1_2_form_a_round_of_two() -> None:
    """Three joined, valid {1,2}: the round closes at once (the largest valid size joined)
    with two; without sizes it would admit all three."""
    state = RoundState(0, "open", [], 1, 3)
    action = _coordinate(state, {"a", "b", "c"}, {0: ["a", "b", "c"]}, (1, 2), now=0.0)
    assert action.kind is ActionKind.FINALIZE and action.members == ("a", "b")
    assert _coordinate(state, {"a", "b", "c"}, {0: ["a", "b", "c"]}, (), now=5.0).members == (
        "a", "b", "c")


def test_an_invalid_count_admits_the_largest_valid_size_below_it() -> None:
    """Valid {2,4}, three live nodes joined after the last call: two train, previous
    members first."""
    state = RoundState(5, "open", ["c", "b"], 1, 4)
    action = _coordinate(state, {"a", "b", "c"}, {5: ["a", "b", "c"]}, (2, 4), max_nodes=4)
    assert action.kind is ActionKind.FINALIZE and action.members == ("c", "b")


def test_below_the_smallest_valid_size_the_round_waits() -> None:
    """Valid {2,4}, one joined: no round (min_nodes 1 is not a valid size)."""
    state = RoundState(0, "open", [], 1, 4)
    action = _coordinate(state, {"a"}, {0: ["a"]}, (2, 4), max_nodes=4)
    assert action.kind is ActionKind.WAIT and "1/2 nodes joined" in action.reason


def test_a_joiner_that_makes_no_valid_size_is_not_announced() -> None:
    """Final at 2 of {2,4}, one joiner: no JOIN (3 is invalid, it is a spare); a second
    joiner makes 4: announced."""
    state = RoundState(1, "final", ["a", "b"], 1, 4)
    one = RendezvousView(state, frozenset({"a", "b", "c"}), {2: ["c"]})
    assert nodes_waiting(one, 1, max_nodes=4, valid_sizes=(2, 4)).kind is MembershipChange.NONE
    two = RendezvousView(state, frozenset({"a", "b", "c", "d"}), {2: ["c", "d"]})
    assert nodes_waiting(two, 1, max_nodes=4, valid_sizes=(2, 4)).kind is MembershipChange.JOIN
    assert nodes_waiting(one, 1, max_nodes=4).kind is MembershipChange.JOIN  # all sizes


def test_a_lost_member_reopens_and_the_spare_completes_the_round_at_once() -> None:
    """Valid {1,2}, b lost, the spare c joined the next round: it closes at once at 2."""
    final = RoundState(1, "final", ["a", "b"], 1, 3)
    view = RendezvousView(final, frozenset({"a", "c"}), {2: ["c"]}, coordinator="a")
    opened = decide_coordination(view, CoordinatorMemory(), me="a", min_nodes=1, max_nodes=3,
                                 last_call_timeout_s=1.0, now=0.0, valid_sizes=(1, 2))
    assert opened.kind is ActionKind.OPEN_NEXT and opened.changed == ("b",)
    state = RoundState(2, "open", ["a", "b"], 1, 3)
    action = _coordinate(state, {"a", "c"}, {2: ["c", "a"]}, (1, 2), now=0.0)
    assert action.kind is ActionKind.FINALIZE and action.members == ("a", "c")


def test_spare_reason_says_full_or_invalid_size() -> None:
    """The reason status shows: the largest valid size, max_nodes, or an invalid next size."""
    assert "largest valid size (2 nodes; valid sizes 1,2)" in spare_reason(2, 3, (1, 2))
    assert "full (max_nodes=2" in spare_reason(2, 2)
    assert "3 nodes is not a valid world size" in spare_reason(2, 4, (2, 4))
    assert spare_reason(1, 3) == "" and spare_reason(2, 4, (2, 3, 4)) == ""
    final = RoundState(1, "final", ["a", "b"], 1, 3)
    assert is_spare(final, "c", 3, (1, 2)) and not is_spare(final, "c", 3)


# --- configuration ------------------------------------------------------------------------

_TOML = """
[job]
name = "demo"
nnodes = "1:3"
[etcd]
endpoints = ["127.0.0.1:2379"]
[workers]
command = ["train.py"]
"""


def _load(tmp_path: Path, extra: str = "", overrides=None):
    path = tmp_path / "agent.toml"
    path.write_text(_TOML + extra)
    return load_config(str(path), {}, overrides or {}, hostname="host-a", check_files=False)


def test_valid_sizes_from_the_file_and_the_flag_reach_the_rendezvous(tmp_path) -> None:
    """TOML list, flag text "1,2" and a global batch all end in RendezvousSettings."""
    cfg = _load(tmp_path, "[rendezvous]\nvalid_sizes = [2, 1]\n")
    assert RendezvousSettings.from_config(cfg).valid_sizes == (1, 2)
    cfg = _load(tmp_path, overrides={"rendezvous.valid_sizes": "1,2"})
    assert RendezvousSettings.from_config(cfg).valid_sizes == (1, 2)
    cfg = _load(tmp_path, overrides={"rendezvous.global_batch_size": "2"})
    assert RendezvousSettings.from_config(cfg).valid_sizes == (1, 2)
    assert RendezvousSettings.from_config(_load(tmp_path)).valid_sizes == ()


@pytest.mark.parametrize(("extra", "fragment"), [
    ("valid_sizes = []", "an empty list allows no world size"),
    ("valid_sizes = [2, 4]", "4 outside job.nnodes = '1:3'; list node counts between 1 and 3"),
    ("valid_sizes = [0]", "at least 1"),
    ("global_batch_size = 5\nvalid_sizes = [2, 3]", "none of [2, 3] splits it evenly"),
])
def test_bad_valid_sizes_are_one_line_config_errors(tmp_path, extra, fragment) -> None:
    """Empty, outside nnodes, zero, none valid: exit 78, one line naming the key and fix."""
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, "[rendezvous]\n" + extra + "\n")
    message = str(info.value)
    assert fragment in message and "rendezvous." in message and "\n" not in message, message
    assert info.value.exit_code == EX_CONFIG


def test_plain_torchrun_refuses_sizes_derived_from_the_batch(monkeypatch) -> None:
    """Under torchrun the rendezvous cannot see --nproc-per-node: a global batch rule is a
    config error naming ELASTICD_RENDEZVOUS_VALID_SIZES, before any etcd client exists."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elasticd.rendezvous.registry import create_handler

    monkeypatch.setenv("ELASTICD_RENDEZVOUS_GLOBAL_BATCH_SIZE", "8")
    params = RendezvousParameters(backend="etcd-v3", endpoint="127.0.0.1:1", run_id="job",
                                  min_nodes=1, max_nodes=2)
    with pytest.raises(ConfigError, match="set ELASTICD_RENDEZVOUS_VALID_SIZES") as info:
        create_handler(params)
    assert info.value.exit_code == EX_CONFIG


def test_a_member_left_out_for_an_invalid_size_is_not_reported_lost() -> None:
    """4 members of sizes {2,4}, d lost: a, b, c rejoin, 2 are admitted; c (joined, alive)
    waits as a spare and is not reported as a dropped (lost) member; d is."""
    from elasticd.rendezvous.protocol import dropped_members

    opened = RoundState(6, "open", ["a", "b", "c", "d"], 1, 4)
    action = _coordinate(opened, {"a", "b", "c"}, {6: ["a", "b", "c"]}, (2, 4), max_nodes=4)
    assert action.kind is ActionKind.FINALIZE and action.members == ("a", "b")
    view = RendezvousView(opened, frozenset({"a", "b", "c"}), {6: ["a", "b", "c"]})
    assert dropped_members(view, opened, action.members) == ("d",)
