"""Valid world sizes: at which node counts a round may form. Pure.

Why: a job whose global batch must split evenly (or whose model is sharded over a fixed
mesh) trains at some world sizes only. Admitting every node up to ``max_nodes`` formed a
round at an invalid size; the workers then stopped with exit 78 (the batch did not
divide) and the job re-formed without the node that was one too many. Instead the round
forms at the largest valid size the available nodes reach, and the rest wait as spares
(``protocol.is_spare``), admitted when a member is lost or drained.

Sizes are **node counts**, like ``job.nnodes``: ``rendezvous.valid_sizes = [1, 2, 4]``. Or
they are derived from the global batch (``rendezvous.global_batch_size``): ``n`` nodes are
valid when the batch splits evenly over their ``n x nproc_per_node`` workers (the rule of
``elasticd.data.batching.plan_global_batch`` without ``allow_uneven``). Both set: a size
must satisfy both. Neither: every size in ``min..max`` is valid (``()``, as before).
"""

from __future__ import annotations

from collections.abc import Sequence

from elasticd.errors import ConfigError

ALL_SIZES: tuple[int, ...] = ()  # every size in min_nodes..max_nodes is valid


def resolve_valid_sizes(listed: Sequence[int], global_batch_size: int, nproc_per_node: int, *,
                        min_nodes: int, max_nodes: int) -> tuple[int, ...]:
    """The job's valid node counts, sorted, or ``ALL_SIZES`` when none are declared.

    Args:
        listed: ``rendezvous.valid_sizes`` (node counts; empty: not declared).
        global_batch_size: ``rendezvous.global_batch_size`` (0: not declared).
        nproc_per_node: workers per node (the derived rule counts workers).
        min_nodes, max_nodes: ``job.nnodes``.

    Raises:
        ConfigError: a listed size outside ``min..max``, or no size in ``min..max`` valid.
    """
    if not listed and not global_batch_size:
        return ALL_SIZES
    nnodes = f"{min_nodes}:{max_nodes}"
    outside = sorted({n for n in listed if not min_nodes <= n <= max_nodes})
    if outside:
        raise ConfigError(
            f"rendezvous.valid_sizes = {list(listed)}: {', '.join(map(str, outside))} outside "
            f"job.nnodes = {nnodes!r}; list node counts between {min_nodes} and {max_nodes}, "
            "or widen nnodes")
    sizes = set(listed) if listed else set(range(min_nodes, max_nodes + 1))
    if global_batch_size:
        sizes = {n for n in sizes if global_batch_size % (n * nproc_per_node) == 0}
    if not sizes:
        why = (f"none of {sorted(set(listed))} " if listed else f"no node count in {nnodes} ")
        fits = [n for n in range(min_nodes, max_nodes + 1)
                if global_batch_size % (n * nproc_per_node) == 0]
        fix = (f"list node counts that do ({', '.join(map(str, fits))})" if fits else
               f"use a global batch divisible by {min_nodes * nproc_per_node} "
               f"({min_nodes} node(s) x {nproc_per_node} worker(s)), or change nnodes")
        raise ConfigError(
            f"rendezvous.global_batch_size = {global_batch_size}: {why}splits it evenly over "
            f"{nproc_per_node} worker(s) per node; {fix}")
    return tuple(sorted(sizes))


def largest_size(valid: Sequence[int], max_nodes: int) -> int:
    """The most nodes a round admits: the largest valid size (``max_nodes`` for all)."""
    return max(valid) if valid else max_nodes


def smallest_size(valid: Sequence[int], min_nodes: int) -> int:
    """The fewest nodes a round forms with: the smallest valid size (``min_nodes`` for all)."""
    return min(valid) if valid else min_nodes


def admitted_size(available: int, valid: Sequence[int], *, min_nodes: int, max_nodes: int) -> int:
    """How many of ``available`` nodes a round admits: the largest valid size <= available
    (and <= ``max_nodes``); 0 when even the smallest does not fit. The rest wait as spares."""
    if not valid:
        return min(available, max_nodes) if available >= min_nodes else 0
    return max((n for n in valid if n <= available), default=0)


def describe(valid: Sequence[int]) -> str:
    """``"valid world sizes 1,2 nodes"`` for logs and status, ``""`` for all sizes."""
    return f"valid world sizes {','.join(map(str, valid))} nodes" if valid else ""
