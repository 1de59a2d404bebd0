"""Hot spares: when a node waits as a spare (pure protocol)."""

from __future__ import annotations

from elasticd.records import RoundState
from elasticd.rendezvous.protocol import is_spare


def _state(phase: str, members: list[str]) -> RoundState:
    return RoundState(round=3, phase=phase, members=members, min_nodes=1, max_nodes=2)


def test_a_node_outside_a_full_final_round_is_a_spare() -> None:
    """Final round at max_nodes without us: spare (its join deadline must not run out)."""
    assert is_spare(_state("final", ["a", "b"]), "c", 2)


def test_room_an_open_round_or_membership_is_not_spare() -> None:
    """Room left (it will be admitted), an open round (joining), a member, no round yet."""
    assert not is_spare(_state("final", ["a"]), "c", 2)
    assert not is_spare(_state("open", ["a", "b"]), "c", 2)
    assert not is_spare(_state("final", ["a", "b"]), "a", 2)
    assert not is_spare(None, "c", 2)
