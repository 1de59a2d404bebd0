"""The round protocol as pure decisions: a view of etcd in, one action (and a reason) out.

Modelled on torch's ``_RendezvousJoinOp`` -> ``_Action``: the executor
(``EtcdRendezvousHandler``) reads a ``RendezvousView`` from its watch cache, asks
``decide_join`` what to do, performs that one action as an etcd transaction guarded by
the state key's mod_revision, and asks again. Because every state change is a
compare-and-swap, any number of nodes can run this loop at once: the first write wins
and the others see the new state on their next look.

A round moves ``open`` -> ``final``:

- ``open``: nodes put ``joins/<round>/<node>`` (on their lease, so a dead joiner
  vanishes). Any joined node may finalize once ``max_nodes`` joined, or ``min_nodes``
  joined and either every live node joined or ``last_call_timeout`` passed since the
  minimum was reached. A live node whose agent a liveness probe proved gone
  (``proven_dead``: a refused connection, liveness.py) does not hold the last call.
  The job's first round (no previous members: nobody trained yet) also *settles*: with
  ``min_nodes < max_nodes`` it stays open ``start_settle_s`` after the minimum joined,
  even when every live node joined, so that nodes started together train together (a
  node still importing torch has no lease yet; closing at once re-ran a short script
  when it arrived: issue 25).
- ``final``: ``members`` lists nodes in rank order. Ranks are dense (0..n-1) and stable:
  members of the previous round keep their relative order, newcomers follow in join
  order.
- A node that has used round r (its workers ran) and calls ``next_rendezvous`` again,
  or any node that sees a member of the final round without a live lease, opens r+1.
  So does a member of final round r that left it cleanly and came back (a new agent
  after a drain or ``elasticd stop``, then ``elasticd start``): its leave retired the
  round, which it never re-enters.
- A node that leaves cleanly writes ``left/<round>/<node>`` (``drained`` or ``finished``)
  *before* it revokes its lease, so the others can tell a leave from a loss. A drained
  member is a membership change (the job re-forms without it, at once); a finished member
  is none: its ranks completed the job, the others finish too, and the job never
  re-forms (a node that would open the next round reads the job as closed instead).
  A node that arrives late pre-registers for r+1 and waits; members see it through
  ``num_nodes_waiting`` and re-rendezvous.

Watch fan-out (why there is a coordinator): one node at a time holds
``rdzv/coordinator`` (on its lease; the others take over by compare-and-swap when it
vanishes). Only the coordinator watches ``nodes/`` and every ``joins/`` key: it has the
*full* view, closes open rounds (``decide_coordination``) and opens the next round when
a member is lost or leaves, writing the cause and the nodes concerned into the new
round's state (``RoundState.cause``/``changed``); late joiners it announces in
``rdzv/waiting`` (``ANNOUNCE``) and the members open the next round themselves once
they have drained, as before. Every other node has a *partial* view: the state key,
``closed``, ``coordinator``, ``waiting``, ``left/`` and ``failures/``, plus its own
joins, and no liveness; it learns of membership changes from those keys. So a round of N nodes costs O(N) watch events (N joins seen by one
watcher, each state write seen by N), not O(N^2) (every join seen by every node).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from elasticd.records import RoundState
from elasticd.rendezvous.sizes import ALL_SIZES, admitted_size, largest_size, smallest_size

LEFT_DRAINED = "drained"  # stopped (drain, stop signal): the others re-form without it
LEFT_FINISHED = "finished"  # its workers completed: the job is done, nobody re-forms
LEAVE_KINDS = (LEFT_DRAINED, LEFT_FINISHED)


class ActionKind(enum.Enum):
    INIT = "init"  # create the state key (round 0, open)
    OPEN_NEXT = "open_next"  # CAS final(r) -> open(r+1)
    JOIN = "join"  # put joins/<round>/<me>
    FINALIZE = "finalize"  # CAS open(r) -> final(r, members)
    WAIT = "wait"  # nothing to do until the view changes (or `until`)
    DONE = "done"  # this node is in the final round
    NONE = "none"  # (coordinator) nothing to do: not the coordinator, or nothing changed
    ANNOUNCE = "announce"  # (coordinator) publish the nodes waiting to join round `round`
    ATTRIBUTE = "attribute"  # (coordinator) every member of `round` reported: `members` in order
    CLOSED = "closed"  # the job is closed
    TIMEOUT = "timeout"  # join_timeout passed


@dataclass(frozen=True)
class Action:
    """What to do next, and why (logged when the reason changes)."""

    kind: ActionKind
    reason: str
    round: int = -1
    members: tuple[str, ...] = ()
    until: float | None = None  # for WAIT: wake up by then even if nothing changes
    # For OPEN_NEXT: why (a MembershipChange value, "" for a re-rendezvous) and who.
    cause: str = ""
    changed: tuple[str, ...] = ()
    # For WAIT in the last call: the stragglers holding the round open; a liveness probe
    # that proves one gone (``proven_dead``) lets the round close without it.
    probe: tuple[str, ...] = ()


@dataclass(frozen=True)
class RendezvousView:
    """What a node knows of etcd at one moment (from its watch cache)."""

    state: RoundState | None
    alive: frozenset[str]  # node ids with a live lease (node record present)
    joins: Mapping[int, Sequence[str]] = field(default_factory=dict)  # round -> nodes in join order
    closed: bool = False
    # round -> failure reporters in order: a full view's from the reports themselves, a
    # partial view's its own report plus the coordinator's verdict (``rdzv/attribution``)
    failures: Mapping[int, Sequence[str]] = field(default_factory=dict)
    # round -> {node: LEFT_DRAINED | LEFT_FINISHED}: members that left that round cleanly
    left: Mapping[int, Mapping[str, str]] = field(default_factory=dict)
    coordinator: str | None = None  # holder of rdzv/coordinator
    # rdzv/waiting as last announced by the coordinator: (round, nodes waiting to join it).
    # A partial view's ``joins`` already include these nodes.
    announced: tuple[int, tuple[str, ...]] | None = None
    # True: ``alive`` and ``joins`` are complete (the coordinator's view, or a test's).
    # False: ``alive`` is unknown (empty) and ``joins`` holds only this node's own joins.
    full: bool = True
    attributed: int | None = None  # the round ``rdzv/attribution`` holds the verdict of
    # Stragglers the coordinator ejected, on probation (``rdzv/probation/``): node -> why,
    # in words. They may join rounds but are not admitted (nor announced) until it ends.
    probation: Mapping[str, str] = field(default_factory=dict)


@dataclass
class JoinProgress:
    """Per-call memory of one ``next_rendezvous`` (not shared between nodes)."""

    me: str
    last_round: int | None  # round this node last completed (its workers ran in it)
    deadline: float  # join_timeout
    min_reached_at: dict[int, float] = field(default_factory=dict)


def order_members(previous: Sequence[str], joined: Sequence[str], max_nodes: int) -> tuple[str, ...]:
    """Rank order for a new round: previous members first (relative order kept), then newcomers.

    Args:
        previous: members of the last final round, in rank order.
        joined: nodes joined to the new round, in join order.
        max_nodes: at most this many are admitted; the rest wait for the next round.
    """
    joined_set = set(joined)
    kept = [n for n in previous if n in joined_set]
    kept_set = set(kept)
    newcomers = [n for n in joined if n not in kept_set]
    return tuple((kept + newcomers)[:max_nodes])


@dataclass(frozen=True)
class Departures:
    """Members of a final round without a live lease, by how they went."""

    lost: tuple[str, ...] = ()  # no clean-leave marker: crashed, frozen, cut off
    drained: tuple[str, ...] = ()  # left cleanly, the job goes on without them
    finished: tuple[str, ...] = ()  # left because their workers completed the job

    @property
    def any(self) -> bool:
        return bool(self.lost or self.drained or self.finished)


def departures(view: RendezvousView, state: RoundState) -> Departures:
    """Sort the gone members of ``state`` into lost, drained and finished. Pure.

    A partial view knows no leases: it sees only clean leaves (written just before the
    lease is revoked); losses reach it as a new round opened by the coordinator.
    """
    left = view.left.get(state.round, {})
    if view.full:
        gone = [m for m in state.members if m not in view.alive]
    else:
        gone = [m for m in state.members if m in left]
    return Departures(
        lost=tuple(m for m in gone if m not in left),
        drained=tuple(m for m in gone if left.get(m) == LEFT_DRAINED),
        finished=tuple(m for m in gone if left.get(m) == LEFT_FINISHED),
    )


def dropped_members(view: RendezvousView, opened: RoundState,
                    members: Sequence[str]) -> tuple[str, ...]:
    """Members of the previous round left out of the round being finalized, that neither
    left cleanly nor were reported lost when ``opened`` was opened. Pure.

    A round opened at once on a failed collective (live re-formation's fast detection)
    closes while the dead node's lease still runs: it is never "lost" at the opening, so
    the finalizer reports it, or `elasticd status` would show no event for a killed node.

    Args:
        view: the finalizer's view (for the clean leaves of the previous round).
        opened: the open round's state: it carries the previous round's members, and the
            nodes its opener already reported (``changed`` when ``cause`` is member_lost).
        members: the members of the round being finalized.
    """
    left = view.left.get(opened.round - 1, {})
    reported = set(opened.changed) if opened.cause in (MembershipChange.MEMBER_LOST.value,
                                                       MembershipChange.MEMBER_HUNG.value) else set()
    # A previous member that joined the round but was left out is alive: it waits as a
    # spare (an invalid world size, ``valid_sizes``), it was not lost.
    joined = set(view.joins.get(opened.round, ()))
    return tuple(m for m in opened.members
                 if m not in members and m not in left and m not in reported and m not in joined)


def decide_join(view: RendezvousView, progress: JoinProgress, *, min_nodes: int, max_nodes: int,
                last_call_timeout_s: float, now: float,
                proven_dead: frozenset[str] = frozenset(), start_settle_s: float = 0.0,
                defer_lost_until: float | None = None,
                valid_sizes: Sequence[int] = ALL_SIZES,
                hold_previous_until: float | None = None) -> Action:
    """Decide this node's next step towards being in a final round. Pure; see module doc.

    ``valid_sizes``: the node counts a round may form at (``rendezvous.sizes``; empty: all).

    ``proven_dead``: nodes whose agent a liveness probe proved gone (their lease may still
    run); they do not hold an open round's last call (see ``_close_open_round``).
    ``start_settle_s``: how long the job's first round stays open once ``min_nodes`` joined.
    ``defer_lost_until``: as for ``decide_coordination``: while in the future, members
    lost with etcd's outage may still re-register in their round, so their loss opens no
    round yet (WAIT). A joiner that opened one then trained from the checkpoint beside a
    member that re-registered and trained on in the old round (the soak, issue 26).
    """
    me = progress.me
    if view.closed:
        return Action(ActionKind.CLOSED, "the rendezvous is closed")
    if now >= progress.deadline:
        return Action(ActionKind.TIMEOUT, "join_timeout passed before a round completed")
    state = view.state
    if state is None:
        return Action(ActionKind.INIT, "no round yet: opening round 0", round=0)
    r = state.round

    if state.phase == "final":
        used = progress.last_round is not None and progress.last_round >= r
        # Our previous agent left this round (a drain, `elasticd stop`): the leave ended
        # it, for us at least. Re-entering it would train alone in a round the next
        # arrival supersedes (issue 26): a new agent opens a new round instead.
        retired = me in state.members and not used and view.left.get(r, {}).get(me) == LEFT_DRAINED
        if me in state.members and not used and not retired:
            return Action(ActionKind.DONE, f"member of final round {r}", round=r,
                          members=tuple(state.members))
        gone = departures(view, state)
        if gone.finished:
            # Its ranks completed the job: a next round would re-run a finished job (or
            # wait forever for the finished node).
            return Action(ActionKind.CLOSED, f"round {r} finished: {','.join(gone.finished)} "
                          "completed the job")
        # Our own earlier leave is not a change the others must hear of (we are back).
        gone = replace(gone, drained=tuple(m for m in gone.drained if m != me))
        lost = [*gone.lost, *gone.drained]
        if gone.lost and defer_lost_until is not None and now < defer_lost_until:
            return Action(ActionKind.WAIT, f"round {r} lost {','.join(gone.lost)}; etcd was in "
                          "trouble, giving them time to re-register", round=r,
                          until=min(defer_lost_until, progress.deadline))
        if used or lost or retired:
            why, cause = ((f"round {r} lost {','.join(gone.lost)}", MembershipChange.MEMBER_LOST.value)
                          if gone.lost else
                          (f"{','.join(gone.drained)} left round {r}", MembershipChange.MEMBER_LEFT.value)
                          if gone.drained else
                          (f"round {r} ended when {me} left it", "") if retired
                          else (f"re-rendezvous after round {r}", ""))
            return Action(ActionKind.OPEN_NEXT, why + f": opening round {r + 1}", round=r + 1,
                          cause=cause, changed=tuple(lost))
        # Late arrival: pre-register for the next round and wait to be admitted.
        if me not in view.joins.get(r + 1, ()):
            return Action(ActionKind.JOIN, f"round {r} is final without us: waiting for round {r + 1}",
                          round=r + 1)
        return Action(ActionKind.WAIT, f"waiting for members of round {r} to admit us", round=r + 1,
                      until=progress.deadline)

    # open round
    joined_all = list(view.joins.get(r, ()))
    if me not in joined_all:
        return Action(ActionKind.JOIN, f"joining open round {r}", round=r)
    if not view.full:
        return Action(ActionKind.WAIT, f"round {r}: joined, waiting for the coordinator "
                      f"({view.coordinator or 'being elected'}) to close it", round=r,
                      until=progress.deadline)
    return _close_open_round(view, state, progress.min_reached_at, min_nodes=min_nodes,
                             max_nodes=max_nodes, last_call_timeout_s=last_call_timeout_s, now=now,
                             deadline=progress.deadline, proven_dead=proven_dead,
                             start_settle_s=start_settle_s, valid_sizes=valid_sizes,
                             hold_previous_until=hold_previous_until)


def is_spare(state: RoundState | None, me: str, max_nodes: int,
             valid_sizes: Sequence[int] = ALL_SIZES) -> bool:
    """Whether ``me`` waits as a hot spare: the job's round is final and full (``max_nodes``
    members, or the largest of ``valid_sizes``) without us, or one more node would make an
    invalid size (members 2 of valid sizes {2, 4}: a third node waits). Pure.

    A spare is registered and has joined the next round; it is admitted in the round the
    members open when one of them is lost or drained (its join is already in), and never
    closes a round nor changes the running one (``nodes_waiting`` announces joiners only
    while there is room). Why it matters: its join deadline must not run out -- a spare
    waits as long as the job runs, where a node waiting for a job to *start* gives up after
    ``join_timeout``.
    """
    if state is None or state.phase != "final" or me in state.members:
        return False
    return spare_reason(len(state.members), max_nodes, valid_sizes) != ""


def spare_reason(members: int, max_nodes: int, valid_sizes: Sequence[int] = ALL_SIZES) -> str:
    """Why a node outside a final round of ``members`` nodes waits as a spare, in words
    (shown by ``status``); ``""`` when there is room for it. Pure."""
    if members >= largest_size(valid_sizes, max_nodes):
        if valid_sizes and largest_size(valid_sizes, max_nodes) < max_nodes:
            return (f"the job is at its largest valid size ({members} nodes; valid sizes "
                    f"{','.join(map(str, valid_sizes))})")
        return f"the job is full (max_nodes={max_nodes} members)"
    if admitted_size(members + 1, valid_sizes, min_nodes=1, max_nodes=max_nodes) <= members:
        return (f"{members + 1} nodes is not a valid world size (valid sizes "
                f"{','.join(map(str, valid_sizes))})")
    return ""


def early_join_round(state: RoundState | None) -> int | None:
    """The round a node may join before its agent has imported torch (a node of the
    job's start, ``agent/boot.py``), or None: the job's first round while it is open
    (no previous members: nobody trains yet). Joined then, a node started with the others
    is in that round however long its torch import takes; any other round it joins the
    usual way, once its agent is ready. ``state`` None: open round 0 first. Pure.
    """
    if state is None:
        return 0
    if state.phase == "open" and not state.members:
        return state.round
    return None


def _close_open_round(view: RendezvousView, state: RoundState, min_reached_at: dict[int, float], *,
                      min_nodes: int, max_nodes: int, last_call_timeout_s: float, now: float,
                      deadline: float, proven_dead: frozenset[str] = frozenset(),
                      start_settle_s: float = 0.0, valid_sizes: Sequence[int] = ALL_SIZES,
                      hold_previous_until: float | None = None) -> Action:
    """FINALIZE the open round ``state`` if it may close now, else WAIT (full view only).

    ``hold_previous_until``: after etcd trouble, a straggler that was a member of the
    previous final round holds the last call until then, not only ``last_call_timeout``: it
    holds the newest state, and it may still be reconnecting to etcd (soak seed 74018: a
    node that joined during the outage coordinated, closed the round a second after etcd
    came back without the member that had trained on, and trained from an older checkpoint).

    A straggler (a live lease, not joined) in ``proven_dead`` holds nothing open: its
    agent is gone (a probe was refused), only its lease has not expired yet. Only the
    last call's wait for it is skipped; ``min_nodes`` still applies, and a node wrongly
    left out rejoins through the normal join path. WAIT in the last call names the
    stragglers in ``probe``.

    The job's first round (``state.members`` empty: no previous round, nobody trained)
    closes below ``max_nodes`` no earlier than ``start_settle_s`` after ``min_nodes``
    joined, and its last call lasts at least as long: a node started at the same time
    may not hold a lease yet (it is still importing torch).

    With ``valid_sizes`` the round closes at once when the largest valid size joined, and
    admits the largest valid size the joined nodes reach; the others stay joined to it and
    wait as spares (they are in the next round).
    """
    r = state.round
    # Nodes ejected when this round was opened (hung) neither join it nor hold its last
    # call: their agents kill their workers and join the next round, cold.
    out = set(ejected(state))
    # Stragglers on probation wait as spares: joined (they hold no last call), not admitted.
    joined = [n for n in view.joins.get(r, ()) if n in view.alive and n not in out
              and n not in view.probation]
    full_at = largest_size(valid_sizes, max_nodes)

    def admit(nodes: Sequence[str]) -> tuple[str, ...]:
        size = admitted_size(len(nodes), valid_sizes, min_nodes=min_nodes, max_nodes=max_nodes)
        return order_members(_previous_members(state), nodes, size)

    if len(joined) >= full_at:
        why = f"max_nodes={max_nodes}" if full_at == max_nodes else f"the largest valid size {full_at}"
        return Action(ActionKind.FINALIZE, f"round {r}: {why} joined", round=r,
                      members=admit(joined))
    min_nodes = smallest_size(valid_sizes, min_nodes)
    if len(joined) >= min_nodes:
        first = min_reached_at.setdefault(r, now)
        settled = first + (start_settle_s if not state.members else 0.0)
        stragglers = sorted(view.alive - set(joined) - proven_dead - out - set(view.probation))
        # After etcd trouble, the previous round's members hold the round, alive or not: a
        # lease may have expired with the outage (it is re-registered within a TTL) and a
        # live one may still be reconnecting. Those that left that round cleanly do not.
        left = view.left.get(r - 1, {})
        held = ([n for n in state.members if n not in joined and n not in proven_dead
                 and n not in out and n not in view.probation and n not in left]
                if hold_previous_until is not None and now < hold_previous_until else [])
        if not stragglers:
            if now < settled:
                return Action(ActionKind.WAIT, f"round {r}: {len(joined)} joined, first round "
                              f"settling {start_settle_s:g}s for nodes started together",
                              round=r, until=min(settled, deadline))
            if held:
                assert hold_previous_until is not None
                return Action(ActionKind.WAIT, f"round {r}: {len(joined)} joined; etcd was in "
                              f"trouble, waiting for {','.join(held)} of the previous round",
                              round=r, until=min(hold_previous_until, deadline))
            dead = sorted((view.alive - set(joined)) & proven_dead)
            members = admit(joined)
            why = f"; {','.join(dead)} proven dead (probe refused)" if dead else ""
            return Action(ActionKind.FINALIZE, f"round {r}: all {len(joined)} live nodes joined{why}",
                          round=r, members=members)
        last_call = max(first + last_call_timeout_s, settled)
        why = ""
        if held and hold_previous_until is not None and hold_previous_until > last_call:
            last_call = hold_previous_until
            why = f" (members of the previous round after etcd trouble: {','.join(held)})"
        if now >= last_call:
            members = admit(joined)
            return Action(ActionKind.FINALIZE,
                          f"round {r}: last call passed with {len(joined)} nodes "
                          f"(not joined: {','.join(stragglers)})", round=r, members=members)
        return Action(ActionKind.WAIT, f"round {r}: {len(joined)} joined, last call for "
                      f"{','.join(stragglers)}{why}", round=r, until=min(last_call, deadline),
                      probe=tuple(stragglers))
    return Action(ActionKind.WAIT, f"round {r}: {len(joined)}/{min_nodes} nodes joined", round=r,
                  until=deadline)


def _previous_members(state: RoundState) -> Sequence[str]:
    # An open round carries the previous final round's members so ranks stay stable.
    return state.members


class MembershipChange(enum.Enum):
    """Why members should re-rendezvous; decides how the agent stops its workers."""

    NONE = "none"  # nobody waits
    NEWER_ROUND = "newer_round"  # someone else opened a round after ours
    MEMBER_LOST = "member_lost"  # a member of our round has no live lease (and did not leave)
    MEMBER_LEFT = "member_left"  # a member of our round drained and left cleanly
    # the coordinator ejected a member whose workers hang the job (rendezvous.hangs.find_hung)
    MEMBER_HUNG = "member_hung"
    # the coordinator ejected a straggler: the job is faster without it (rendezvous.stragglers)
    MEMBER_SLOW = "member_slow"
    JOIN = "join"  # only new nodes wait to join: nobody was lost (a scale-up)
    LEASE_LOST = "lease_lost"  # (handler only) this node's own lease is gone


@dataclass(frozen=True)
class Waiting:
    """What ``nodes_waiting`` found: how many nodes wait, why (human-readable), and the kind."""

    count: int = 0
    reason: str = ""
    kind: MembershipChange = MembershipChange.NONE
    nodes: tuple[str, ...] = ()  # the nodes lost, left or waiting to join (when known)


def nodes_waiting(view: RendezvousView, my_round: int, *, max_nodes: int,
                  valid_sizes: Sequence[int] = ALL_SIZES) -> Waiting:
    """How many nodes wait for this node to re-rendezvous, why, and what kind of change. Pure.

    Counts as waiting (so torch's agent restarts the group without spending the restart
    budget): a newer round opened by someone else, a member of our round whose lease is
    gone (``MEMBER_LOST``, or ``MEMBER_LEFT`` when it wrote a drained leave), and late
    joiners for the next round while there is room for them. The first that applies names
    the kind, in that order; so ``JOIN`` means no member was lost and no newer round
    exists. A member that *finished* is no change at all (see the module docstring).
    Joiners that would not make a larger valid size (``valid_sizes``) are spares, no change.
    """
    state = view.state
    if state is None or view.closed:
        return Waiting()
    if state.round > my_round:
        cause = _CAUSES.get(state.cause) if state.round == my_round + 1 else None
        if cause is not None:  # opened by the coordinator for a change in our round
            return Waiting(max(len(state.changed), 1), f"round {state.round} opened: "
                           f"{_CAUSE_WORDS[cause]}: {','.join(state.changed)}", cause,
                           tuple(state.changed))
        return Waiting(1, f"round {state.round} opened while we are in round {my_round}",
                       MembershipChange.NEWER_ROUND)
    if state.phase != "final":
        return Waiting()
    gone = departures(view, state)
    if gone.lost:
        return Waiting(len(gone.lost), f"members lost: {','.join(gone.lost)}",
                       MembershipChange.MEMBER_LOST, gone.lost)
    if gone.drained:
        return Waiting(len(gone.drained), f"members left: {','.join(gone.drained)}",
                       MembershipChange.MEMBER_LEFT, gone.drained)
    if gone.finished:
        # A peer's ranks completed the job: ours are finishing too. Re-forming (or
        # admitting joiners) would kill healthy workers for a round that never completes.
        return Waiting()
    if len(state.members) < max_nodes:
        waiting = [n for n in view.joins.get(my_round + 1, ())
                   if n not in state.members and (n in view.alive or not view.full)
                   and n not in view.probation]
        grows = admitted_size(len(state.members) + len(waiting), valid_sizes, min_nodes=1,
                              max_nodes=max_nodes) > len(state.members)
        if waiting and grows:
            return Waiting(len(waiting), f"nodes waiting to join: {','.join(waiting)}",
                           MembershipChange.JOIN, tuple(waiting))
    return Waiting()


_CAUSES = {c.value: c for c in (MembershipChange.MEMBER_LOST, MembershipChange.MEMBER_LEFT,
                                MembershipChange.MEMBER_HUNG, MembershipChange.MEMBER_SLOW)}
_CAUSE_WORDS = {MembershipChange.MEMBER_LOST: "members lost",
                MembershipChange.MEMBER_LEFT: "members left",
                MembershipChange.MEMBER_HUNG: "members hung (ejected)",
                MembershipChange.MEMBER_SLOW: "stragglers ejected"}
EJECTIONS = (MembershipChange.MEMBER_HUNG, MembershipChange.MEMBER_SLOW)


def ejected(state: RoundState | None) -> tuple[str, ...]:
    """The nodes the coordinator ejected from the job when it opened ``state`` (a hang or
    a straggler): they take no part in that round; they rejoin the one after (a straggler
    is admitted only once its probation ended). Pure."""
    if state is None or state.cause not in (c.value for c in EJECTIONS):
        return ()
    return tuple(state.changed)


@dataclass
class CoordinatorMemory:
    """What the coordinator remembers between decisions (not shared between nodes)."""

    min_reached_at: dict[int, float] = field(default_factory=dict)


def decide_coordination(view: RendezvousView, memory: CoordinatorMemory, *, me: str, min_nodes: int,
                        max_nodes: int, last_call_timeout_s: float, now: float,
                        defer_lost_until: float | None = None,
                        proven_dead: frozenset[str] = frozenset(),
                        start_settle_s: float = 0.0, finishing: bool = False,
                        valid_sizes: Sequence[int] = ALL_SIZES,
                        hung: tuple[str, str] | None = None,
                        slow: tuple[str, str] | None = None,
                        hold_previous_until: float | None = None) -> Action:
    """The coordinator's duty, run whenever its full view changes. Pure.

    Closes an open round exactly when a joined node of the old protocol would (max
    reached; min reached and every live node joined, or the last call passed), whether or
    not the coordinator itself joined it; opens the next round when the final round
    lost a member or a member drained, writing the cause so that nodes with a partial
    view report the same ``MembershipChange``; and announces late joiners waiting with
    room for them (``rdzv/waiting``), which members read as ``JOIN``.

    Args:
        view: the coordinator's full view.
        memory: per-coordinator memory (when the minimum was first reached, per round).
        me: this node; anything but the holder of ``rdzv/coordinator`` does nothing.
        defer_lost_until: while set and in the future, lost members are not acted on yet
            (etcd itself was in trouble: their leases may have expired with etcd's outage
            and they may still re-register); WAIT until then.
        proven_dead: nodes a liveness probe proved gone: they do not hold a last call.
        start_settle_s: how long the job's first round stays open once ``min_nodes``
            joined (see ``_close_open_round``).
        finishing: the coordinator's own workers completed the job (its agent is closing
            it): no round is opened or announced any more, whatever was lost meanwhile.
        valid_sizes: the node counts a round may form at (empty: every size in min..max).
        hung: (node, reason) when ``rendezvous.hangs.find_hung`` named a member of the final
            round that hangs the job: with no other change, the next round is opened with
            cause ``member_hung`` naming it (it is ejected: ``ejected``).
        slow: (node, reason) when the straggler policy (``rendezvous.stragglers``) ejects a
            member: as ``hung`` (a hang goes first), with cause ``member_slow``.
        hold_previous_until: after etcd trouble, an open round's last call waits until then
            for members of the previous final round (see ``_close_open_round``).

    Returns:
        FINALIZE, OPEN_NEXT (with ``cause``/``changed``), ANNOUNCE (``members`` = the
        waiting nodes, ``round`` = the round they wait for), WAIT (with ``until`` when a
        deadline matters) or NONE.
    """
    state = view.state
    if not view.full or view.coordinator != me:
        return Action(ActionKind.NONE, "not the coordinator")
    if view.closed:
        return Action(ActionKind.NONE, "the rendezvous is closed")
    if finishing:
        # Why: a member whose lease was lost while it finished (an etcd freeze) reads as
        # lost, and a new round for late joiners would retrain from the last committed
        # checkpoint a job that is done (soak seed 777000: 40 steps).
        return Action(ActionKind.NONE, "our workers completed the job: no new round")
    if state is None:
        return Action(ActionKind.NONE, "no round yet")
    if state.phase != "final":
        return _close_open_round(view, state, memory.min_reached_at, min_nodes=min_nodes,
                                 max_nodes=max_nodes, last_call_timeout_s=last_call_timeout_s,
                                 now=now, deadline=float("inf"), proven_dead=proven_dead,
                                 start_settle_s=start_settle_s, valid_sizes=valid_sizes,
                                 hold_previous_until=hold_previous_until)
    r = state.round
    reporters = tuple(view.failures.get(r, ()))
    if reporters and view.attributed != r and all(m in reporters for m in state.members):
        # One verdict that every node watches, instead of every node watching every
        # report: a job-wide worker failure costs O(N) watch events, not O(N^2).
        return Action(ActionKind.ATTRIBUTE, f"round {r}: every member reported a worker "
                      f"failure, {reporters[0]} first", round=r, members=reporters)
    change = nodes_waiting(view, r, max_nodes=max_nodes, valid_sizes=valid_sizes)
    for eject, cause, what in ((hung, MembershipChange.MEMBER_HUNG, "hangs the job"),
                               (slow, MembershipChange.MEMBER_SLOW, "is a straggler")):
        if eject is not None and eject[0] in state.members and len(state.members) > 1 \
                and change.kind in (MembershipChange.NONE, MembershipChange.JOIN):
            # Before a join: the members cannot park for joiners while one of them hangs.
            # A loss or a leave opens the next round anyway (the hang may be its consequence).
            return Action(ActionKind.OPEN_NEXT, f"round {r}: {eject[0]} {what} ({eject[1]}): "
                          f"ejecting it, opening round {r + 1}", round=r + 1,
                          cause=cause.value, changed=(eject[0],))
    if change.kind is MembershipChange.NONE:
        if view.announced is not None and view.announced[0] == r + 1 and view.announced[1]:
            # The announced joiners vanished (or there is no room any more): withdraw, or
            # the members would re-form for nobody.
            return Action(ActionKind.ANNOUNCE, f"round {r}: nobody waits to join any more",
                          round=r + 1)
        return Action(ActionKind.NONE, f"round {r} is final and complete")
    if change.kind is MembershipChange.JOIN:
        # Announced, not opened: the members drain first (a resize loses no step) and open
        # the round themselves, so its last call starts when they are ready, as before.
        if view.announced == (r + 1, change.nodes):
            return Action(ActionKind.NONE, f"round {r}: {change.reason} (announced)")
        return Action(ActionKind.ANNOUNCE, f"round {r}: {change.reason}: announcing them",
                      round=r + 1, members=change.nodes)
    if change.kind is MembershipChange.MEMBER_LOST and defer_lost_until is not None \
            and now < defer_lost_until:
        return Action(ActionKind.WAIT, f"round {r}: {change.reason}; etcd was in trouble, "
                      "giving them time to re-register", round=r, until=defer_lost_until)
    return Action(ActionKind.OPEN_NEXT, f"{change.reason}: opening round {r + 1}", round=r + 1,
                  cause=change.kind.value, changed=change.nodes)


class Attribution(enum.Enum):
    """Whose fault a local worker failure is (see ``attribute_failure``)."""

    MEMBERSHIP = "membership"  # a peer is gone or a newer round exists: spends nothing
    ROOT = "root"  # every live peer reported too and ours was first: spends the budget
    VICTIM = "victim"  # every live peer reported and another was first: spends nothing
    UNDECIDED = "undecided"  # wait for more reports (``ROOT`` once the window passes)


def attribute_failure(view: RendezvousView, my_round: int, me: str,
                      proven_dead: frozenset[str] = frozenset()) -> tuple[Attribution, str]:
    """Decide whether a local worker failure is this node's fault. Pure.

    When one worker dies, its peers' collectives fail within milliseconds, so every node
    sees a "failure". Only the root cause should spend its restart budget; a failure
    that coincides with a peer leaving is a membership change and spends nothing. A
    member in ``proven_dead`` (a liveness probe found its agent gone, before its lease
    expired) is such a departure: the SIGKILL of a node costs no restart budget and no
    wait for the lease.

    Returns:
        (verdict, reason) with verdict ``MEMBERSHIP`` (a peer is gone or a newer round
        exists), ``ROOT`` (every live peer reported a failure too and ours was first),
        ``VICTIM`` (every live peer reported and another was first), or ``UNDECIDED``
        (wait for more reports; the caller treats it as ``ROOT`` once its attribution
        window passes).
    """
    state = view.state
    if state is None:
        return Attribution.UNDECIDED, "no round state"
    if state.round > my_round:
        return Attribution.MEMBERSHIP, f"round {state.round} superseded our round {my_round}"
    gone = departures(view, state)
    if gone.any:
        names = ",".join((*gone.lost, *gone.drained, *gone.finished))
        return Attribution.MEMBERSHIP, f"peer(s) {names} left round {my_round}"
    dead = [m for m in state.members if m in proven_dead and m != me]
    if dead:
        return Attribution.MEMBERSHIP, (f"peer(s) {','.join(dead)} of round {my_round} "
                                        "proven dead (liveness probe refused)")
    reporters = list(view.failures.get(my_round, ()))
    others = [m for m in state.members if m != me]
    if me in reporters and all(m in reporters for m in others):
        if reporters[0] == me:
            return Attribution.ROOT, f"first failure report of round {my_round}"
        return Attribution.VICTIM, f"{reporters[0]} failed first in round {my_round}"
    return Attribution.UNDECIDED, f"waiting for failure reports of round {my_round}"
