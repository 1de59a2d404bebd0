"""etcd outages, as pure decisions: tell "etcd was away" from "the node was away".

After an etcd outage every lease may expire at once (a frozen single-member etcd revokes
them all when it resumes, etcd#15247). Both decisions here tell the two apart by whether
this node itself saw etcd fail or stall recently (``outage_window_s``); the handler
(``etcd_handler.py``) supplies that fact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elasticd.records import RoundState


def outage_window_s(node_ttl_s: float, election_timeout_s: float = 1.0) -> float:
    """How recent a sign of etcd trouble must be to explain an expired lease (seconds).

    An outage may include a leader election: the window covers that too.
    """
    return node_ttl_s + max(5.0, 2.0 * election_timeout_s)


@dataclass(frozen=True)
class LossGrace:
    """What ``loss_grace`` decided, and the memory to pass to its next call."""

    hold: bool  # report no membership change yet: the lost members may re-register
    loss_seen_at: float | None  # first sight of lost members after etcd trouble
    reason: str = ""


def loss_grace(lost: Sequence[str], *, etcd_trouble: bool, loss_seen_at: float | None,
               now: float, node_ttl_s: float, trouble_at: float = float("-inf")) -> LossGrace:
    """Whether to hold back the loss of ``lost`` members for a grace period. Pure.

    Members lost right after this node saw etcd trouble (``etcd_trouble``: within
    ``outage_window_s``) get ``node_ttl_s + 2`` seconds to re-register (``may_resurrect``)
    before it counts as a membership change, counted from the later of the first sight of
    the loss and the latest etcd trouble seen (``trouble_at``).

    Why the latter: the lost members can re-register only while etcd answers. A second
    freeze inside the grace used to eat it (soak seed 880009: etcd frozen 4.2 s, a 0.7 s
    gap, frozen again 4.2 s; the grace ran out as etcd resumed, the coordinator opened the
    next round 0.3 s before the member that trained alone could re-register, and a step
    was retrained).

    Args:
        lost: members of our round without a live lease that did not leave cleanly.
        etcd_trouble: this node saw etcd fail or stall within ``outage_window_s``.
        loss_seen_at: the memory returned by the previous call (None at first).
        now: monotonic time.
        node_ttl_s: the lease TTL.
        trouble_at: when this node last saw etcd fail or stall (the same clock as ``now``).

    Returns:
        The decision and the memory for the next call (reset once nobody is lost).
    """
    if lost and etcd_trouble:
        seen = loss_seen_at or now
        if now - max(seen, trouble_at) < node_ttl_s + 2.0:
            return LossGrace(True, seen, f"members {','.join(lost)} lost right after an etcd "
                             "outage: waiting for them to re-register")
        return LossGrace(False, seen)
    if not lost:
        return LossGrace(False, None)
    return LossGrace(False, loss_seen_at)


def presumed_outage(lost: Sequence[str], state: RoundState | None, *, saw_trouble: bool) -> bool:
    """Whether the loss of ``lost`` is presumed an etcd outage's doing. Pure.

    Yes when this node saw etcd trouble itself, and also when every member of the final
    round is lost at once: a coordinator that came up after etcd's restart saw no trouble,
    yet all the leases that expired together were most likely kept alive by healthy agents
    that reached etcd a moment too late (soak seed 880007: both members' leases went 2 s
    after an etcd restart, a new node opened the next round 30 ms before they re-registered,
    and 19 steps were retrained from storage). Holding back costs node_ttl_s + 2 s in a real
    mass failure, when nothing trains anyway.
    """
    if not lost:
        return False
    if saw_trouble:
        return True
    return (state is not None and state.phase == "final" and bool(state.members)
            and all(m in lost for m in state.members))


def may_resurrect(state: RoundState | None, my_round: int | None, me: str, *,
                  lease_lost: bool, etcd_trouble: bool) -> tuple[bool, str]:
    """Whether this node may re-register in its own round after its lease expired. Pure.

    Allowed only if etcd failed or stalled recently as seen from here (``etcd_trouble``),
    and no round formed without us: the job is still in our final round with us as a
    member, or the next round is open with us among its previous members (a peer whose
    lease came back first opened it; soak seed 74015). Then a new lease (a new
    incarnation) simply replaces the old one, and in the second case the agent re-forms
    into the open round with its workers and their state kept. Otherwise we were the ones
    away (frozen, partitioned) and must rejoin as a new member.

    Returns:
        (allowed, reason).
    """
    if not lease_lost or my_round is None:
        return False, "our lease is alive, or we were never in a round"
    if not etcd_trouble:
        return False, "etcd was fine: this node was away (frozen or cut off)"
    if state is None or me not in state.members:
        return False, f"the job moved on from round {my_round}"
    if state.round == my_round and state.phase == "final":
        return True, "lease expired during an etcd outage; same round"
    if state.round == my_round + 1 and state.phase == "open":
        return True, f"lease expired during an etcd outage; round {state.round} is open with us"
    return False, f"the job moved on from round {my_round}"
