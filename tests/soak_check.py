"""The soak's checker (tests/chaos/test_soak.py), as pure functions over trace rows.

A run's trace (examples/train.py ``--trace``) has one row per rank per completed step:
``step``, ``epoch``, ``round``, ``rank``, ``pid``, ``idx`` (that rank's share) and
``global`` (the step's whole global batch). A step may be attempted more than once (a
restart retrains the steps after the last checkpoint); only its final attempt (its
highest round) is in the model. The single-rank reference (the script without an agent)
has exactly one row per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


def final_attempts(rows: Iterable[Mapping]) -> dict[int, list[Mapping]]:
    """step -> the rows of its final attempt (those of its highest round)."""
    by_step: dict[int, list[Mapping]] = {}
    for r in rows:
        rnd = r["round"] or 0
        kept = by_step.get(r["step"])
        if kept is None or rnd > (kept[0]["round"] or 0):
            by_step[r["step"]] = [r]
        elif rnd == (kept[0]["round"] or 0):
            kept.append(r)
    return by_step


def step_mismatches(rows: Sequence[Mapping], reference: Sequence[Mapping],
                    limit: int = 20) -> list[str]:
    """Every way the run's final attempts differ from the reference, one line each.

    Per step: missing, or any final-attempt row whose epoch or global batch is not the
    reference's, or whose ranks' shares together are not the whole global batch (when
    they add up to its size: every rank wrote its row); steps the reference never trained.
    """
    ref = {r["step"]: r for r in reference}
    got = final_attempts(rows)
    out: list[str] = []
    for step in sorted(ref):
        want = ref[step]
        attempt = got.get(step)
        if attempt is None:
            out.append(f"step {step}: never trained")
            continue
        for r in attempt:
            if r["epoch"] != want["epoch"] or list(r["global"]) != list(want["global"]):
                out.append(f"step {step}: rank {r['rank']} (pid {r['pid']}, round {r['round']}) "
                           f"trained epoch {r['epoch']} {list(r['global'])[:6]}..., the reference "
                           f"epoch {want['epoch']} {list(want['global'])[:6]}...")
                break
        shares = sorted(i for r in attempt for i in r["idx"])
        if len(shares) == len(want["global"]) and shares != sorted(want["global"]):
            ranks = sorted(r["rank"] for r in attempt)
            out.append(f"step {step}: the shares of ranks {ranks} are not its global batch")
    out += [f"step {s}: not in the reference" for s in sorted(set(got) - set(ref))]
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def retrained_steps(rows: Iterable[Mapping]) -> list[int]:
    """Steps trained in more than one round (rolled back and trained again)."""
    rounds: dict[int, set[int]] = {}
    for r in rows:
        rounds.setdefault(r["step"], set()).add(r["round"] or 0)
    return sorted(s for s, v in rounds.items() if len(v) > 1)


@dataclass(frozen=True)
class WorkerStarts:
    """Worker processes that trained, against what the faults explain."""

    seen: int  # distinct worker pids in the trace
    allowed: int  # one per node started, per node frozen past its TTL, per fallback

    @property
    def unexplained(self) -> int:
        return max(self.seen - self.allowed, 0)


def worker_starts(rows: Iterable[Mapping], *, nodes_started: int, nodes_frozen: int,
                  fallbacks: int = 0, rejoins: int = 0, nproc: int = 1) -> WorkerStarts:
    """Count worker starts. With live re-formation a membership change (kill, drain, join,
    an etcd outage) restarts no worker; a node frozen past its TTL comes back a zombie and
    its agent restarts its workers (fenced), once; and a node whose live re-formation fell
    back to a restart (``live_reform_fell_back``: the membership changed again while it
    re-formed, e.g. a peer frozen in the middle of it) restarts its workers once, from the
    checkpoint, by design (docs/failure-model.md). Soak seed 249928404 was that case:
    the checker, not the product, was wrong. ``nodes_frozen`` counts freezes, not nodes:
    seed 880002 froze n1 three times and n1 rejoined twice (8 starts, 7 explained when
    the checker counted n1 once). ``rejoins`` counts ``lease_not_resurrected``: a node whose
    lease etcd dropped in an outage while the round state moved (another node opened or
    joined a round) rejoins as a new member and restarts its workers, by design
    (docs/failure-model.md); soak seed 71211 was that case (an etcd kill while a frozen
    node rejoined), and 74008 (its view already showed the round a peer opened the moment
    etcd came back: it said nothing until the event was logged on that path too)."""
    return WorkerStarts(seen=len({r["pid"] for r in rows}),
                        allowed=(nodes_started + nodes_frozen + fallbacks + rejoins) * nproc)


def unexplained_retrained(retrained: Sequence[int], *, fallback_rounds: int,
                          checkpoint_every: int) -> list[int]:
    """The retrained steps no fallback explains: a fallback to a restart retrains at most
    the steps since the last checkpoint (``checkpoint_every``) once per round in which
    nodes fell back; any more, or any with no fallback, is a finding (all of them)."""
    return list(retrained) if len(retrained) > fallback_rounds * checkpoint_every else []
