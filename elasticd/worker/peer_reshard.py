"""A sharded re-formation that changes the shard size, resharded in memory.

Under pure FSDP2 (a 1-D ``("shard",)`` mesh over every rank) the shard size is the world
size: every loss, drain or join changes it, so no rank's local shards fit the new mesh
and no intact replica exists (:func:`~elasticd.worker.sharded.plan_shard_transfer` says
so). Rather than restart and read the checkpoint, the ranks rebuild the old world's
shards from memory and reshard them onto the new mesh:

- **nobody lost** (a join; every old rank is still here at the newest step): each old
  rank snapshots its live shards now and the new mesh is filled from those (no step lost);
- **ranks lost** (a kill, a drain): the lost ranks' shards come from their peer-RAM
  replicas (:mod:`elasticd.worker.peer_replica`), the survivors' from their own snapshots
  of the same step; every rank rolls back to that step (at most ``k`` steps), sampler,
  optimizer hyper-parameters and RNG with it, so every sample is still trained once.

The exchange: each old rank's index (JSON: boxes, byte ranges, CRCs, and the JSON state
of that rank) goes through the group's c10d store; each new rank works out which old
ranks' boxes overlap its new boxes, and only those bytes move, point to point through the
live transport (:func:`~elasticd.worker.state_broadcast.broadcast_state`); the checkpoint's
own resharding load (:func:`elasticd.checkpoint.shards.fill`) then assembles each new box.
Nothing read from a peer is unpickled: indexes and state are JSON, the bytes a dtype the
index names, each chunk checked against its CRC.

:func:`plan_memory_reshard` decides, from every rank's :class:`MemoryReport`, the step,
who serves each old rank's shards, or why storage must be read; it is pure and
unit-tested. :func:`replica_state` / :func:`apply_replica_state` turn a sharded module,
its optimizers and the rest of the state into the tensors and JSON a snapshot holds, and
back.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elasticd.checkpoint import shards
from elasticd.checkpoint.api import CheckpointCorruptError
from elasticd.worker.peer_replica import NO_HOLDER, Snapshot, plan_peer_recovery
from elasticd.worker.sharded import NOT_HELD, local_of

MAX_HELD = 8  # replicas one rank reports holding (a ring holds 1; more on unequal nodes)
REPORT_LEN = 6 + 2 * MAX_HELD


@dataclass(frozen=True)
class MemoryReport:
    """What one rank reports before an in-memory reshard (fixed-size, for an all_gather).

    Attributes:
        old_rank: its rank in the old world (-1: it holds no state, a joiner).
        old_world: the old world's size (0: none).
        step: the last step its live state completed (``NOT_HELD``: none).
        own_step: the step of its own replica snapshot (-1: none).
        held: (old rank, step) of each peer replica it holds.
        committed: the newest committed checkpoint's step as its agent knows it (-1: none
            or unknown); the plan reads the checkpoint instead of replicas older than it.
    """

    old_rank: int
    old_world: int
    step: int
    own_step: int = -1
    held: tuple[tuple[int, int], ...] = ()
    committed: int = -1

    def encode(self) -> list[int]:
        held = list(self.held[:MAX_HELD])
        flat = [x for pair in held for x in pair] + [-1] * (2 * (MAX_HELD - len(held)))
        return [self.old_rank, self.old_world, self.step, self.own_step, len(held), *flat, self.committed]

    @classmethod
    def decode(cls, values: Sequence[int]) -> MemoryReport:
        n = int(values[4])
        held = tuple((int(values[5 + 2 * i]), int(values[6 + 2 * i])) for i in range(n))
        return cls(int(values[0]), int(values[1]), int(values[2]), int(values[3]), held,
                   int(values[5 + 2 * MAX_HELD]))


@dataclass(frozen=True)
class MemoryPlan:
    """How the new mesh is filled from memory, or why it cannot be.

    Attributes:
        step: the step every rank ends at.
        fresh: True: from the live shards (snapshotted now); False: from the replicas.
        old_world: the old world's size.
        sources: old rank -> the new rank that serves its shards.
        fallback: why storage must be read; None when memory suffices.
    """

    step: int
    fresh: bool = False
    old_world: int = 0
    sources: Mapping[int, int] | None = None
    fallback: str | None = None


def plan_memory_reshard(reports: Sequence[MemoryReport]) -> MemoryPlan:
    """Decide an in-memory reshard from every new rank's report (the same on every rank). Pure.

    Args:
        reports: by new global rank.

    Returns:
        A plan; ``fallback`` names why the shards must be resharded from the checkpoint.
    """
    holding = [(r.old_rank, i) for i, r in enumerate(reports) if r.old_rank >= 0 and r.step != NOT_HELD]
    survivors = dict(holding)
    if not survivors:
        return MemoryPlan(step=NOT_HELD, fallback="no rank holds a state")
    worlds = sorted({reports[i].old_world for i in survivors.values()})
    if len(worlds) != 1 or len(survivors) != len(holding):
        return MemoryPlan(step=NOT_HELD, fallback=(
            f"the ranks holding state do not come from one world (sizes {worlds}, old ranks "
            f"{sorted(o for o, _ in holding)}): the shards are "
            "resharded from the checkpoint"))
    old_world = worlds[0]
    newest = max(reports[i].step for i in survivors.values())
    if len(survivors) == old_world and all(reports[i].step == newest for i in survivors.values()):
        return MemoryPlan(step=newest, fresh=True, old_world=old_world, sources=dict(survivors))
    lost = frozenset(range(old_world)) - set(survivors)
    holders = [NO_HOLDER] * old_world
    replica_steps: dict[int, int] = {}
    for r in reports:
        if r.old_rank in survivors:
            for held, step in r.held:
                if 0 <= held < old_world and held not in replica_steps:
                    holders[held], replica_steps[held] = r.old_rank, step
    own_steps = {o: reports[i].own_step for o, i in survivors.items()}
    # A checkpoint committed after the replicas' step retrains fewer steps than they would
    # (checkpoints more often than every k steps): the restart path loads it.
    committed = max((r.committed for r in reports if r.committed <= newest), default=-1)
    peer = plan_peer_recovery(holders, lost, own_steps, replica_steps, committed_step=committed)
    if peer.fallback is not None:
        return MemoryPlan(step=peer.step, old_world=old_world, fallback=peer.fallback)
    return MemoryPlan(step=peer.step, old_world=old_world,
                      sources={o: survivors[s] for o, s in peer.sources.items()})


# -- the state a snapshot holds ----------------------------------------------------------
def _rng_json(state: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = {"u8": base64.b64encode(value.numpy().tobytes()).decode()}
        elif key == "cuda":
            out[key] = [{"u8": base64.b64encode(v.numpy().tobytes()).decode()} for v in value]
        else:
            out[key] = value
    return out


def _rng_from_json(raw: Mapping[str, Any]) -> dict[str, Any]:
    def u8(entry: Any) -> torch.Tensor:
        if not isinstance(entry, dict) or not isinstance(entry.get("u8"), str):
            raise CheckpointCorruptError("a peer's RNG state is malformed")
        return torch.frombuffer(bytearray(base64.b64decode(entry["u8"])), dtype=torch.uint8)

    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "torch":
            out[key] = u8(value)
        elif key == "cuda":
            out[key] = [u8(v) for v in value]
        else:
            out[key] = value
    return out


def replica_state(state: Mapping[str, Any], module: nn.Module, names: Sequence[str],
                  params: Sequence[torch.Tensor], rng_state: Mapping[str, Any]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DTensors and the JSON state of one rank, as a snapshot holds them.

    Args:
        state: the job's state (``LiveState.state``): the sharded module, its optimizers,
            and objects with a JSON-able ``state_dict`` or plain dicts.
        module, names, params: the sharded module and its parameters, by name.
        rng_state: this rank's :func:`elasticd.checkpoint.rng.capture`.

    Returns:
        (key -> DTensor, JSON-able state).

    Raises:
        TypeError: a state entry that is neither sharded nor JSON (a replica cannot hold it).
    """
    tensors: dict[str, Any] = {}
    extra: dict[str, Any] = {"state": {}, "optim": {}, "rng": _rng_json(rng_state)}
    for key, obj in state.items():
        if obj is module:
            for name, p in zip(names, params, strict=True):
                tensors[f"{key}/{name}"] = p
        elif isinstance(obj, torch.optim.Optimizer):
            index = {id(p): i for i, p in enumerate(p for g in obj.param_groups for p in g["params"])}
            scalars: dict[str, dict[str, Any]] = {}
            for p, entry in obj.state.items():
                i = index[id(p)]
                for k, v in entry.items():
                    if shards.is_dtensor(v):
                        tensors[f"{key}/{i}/{k}"] = v
                    elif isinstance(v, torch.Tensor) and v.dim() == 0:
                        scalars.setdefault(str(i), {})[k] = {
                            "value": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
                    elif v is None or isinstance(v, (bool, int, float)):
                        scalars.setdefault(str(i), {})[k] = {"value": v, "dtype": None}
                    else:
                        raise TypeError(f"optimizer {key!r}: state {k!r} of parameter {i} is "
                                        f"a {type(v).__name__}, neither sharded nor a scalar")
            groups = [{k: v for k, v in g.items() if k != "params"} for g in obj.param_groups]
            extra["optim"][key] = {"groups": groups, "scalars": scalars}
        else:
            extra["state"][key] = obj.state_dict() if hasattr(obj, "state_dict") else dict(obj)
    json.dumps(extra)  # raises TypeError for state a replica cannot hold
    return tensors, extra


def apply_replica_state(state: Mapping[str, Any], module: nn.Module, names: Sequence[str],
                        params: Sequence[torch.Tensor], filled: Mapping[str, Any],
                        extra: Mapping[str, Any]) -> dict[str, Any]:
    """Put resharded tensors and a snapshot's JSON state into the job's state.

    Args:
        state, module, names, params: as :func:`replica_state`, on the new mesh.
        filled: key -> DTensor of the new sharding (from :func:`elasticd.checkpoint.shards.fill`).
        extra: the JSON state of the old rank this rank takes it from.

    Returns:
        The RNG state to restore (:func:`elasticd.checkpoint.rng.restore`).
    """
    with torch.no_grad():
        for key, obj in state.items():
            if obj is module:
                for name, p in zip(names, params, strict=True):
                    local_of(p).copy_(filled[f"{key}/{name}"].to_local())
            elif isinstance(obj, torch.optim.Optimizer):
                saved = extra["optim"][key]
                flat = [p for g in obj.param_groups for p in g["params"]]
                obj.state.clear()
                prefix = f"{key}/"
                for tkey, value in filled.items():
                    if tkey.startswith(prefix) and tkey.count("/") == 2 and tkey.split("/")[1].isdigit():
                        _, i, k = tkey.split("/")
                        obj.state[flat[int(i)]][k] = value
                for i, entry in saved["scalars"].items():
                    for k, v in entry.items():
                        obj.state[flat[int(i)]][k] = (v["value"] if v["dtype"] is None else
                                                      torch.tensor(v["value"], dtype=shards.DTYPES[v["dtype"]]))
                for group, kept in zip(obj.param_groups, saved["groups"], strict=True):
                    group.update({k: tuple(v) if k == "betas" else v for k, v in kept.items()})
    for key, obj in state.items():
        if obj is module or isinstance(obj, torch.optim.Optimizer):
            continue
        value = extra["state"][key]
        if hasattr(obj, "load_state_dict"):
            obj.load_state_dict(value)
        else:
            obj.clear()
            obj.update(value)
    return _rng_from_json(extra["rng"])


# -- the exchange's pure parts -------------------------------------------------------------
def needed_ranks(targets: Mapping[str, Any], chunks_of: Mapping[int, Sequence[shards.Chunk]]) -> set[int]:
    """The old ranks whose boxes overlap this rank's new boxes of ``targets``."""
    boxes = {key: shards.box_of(t) for key, t in targets.items()}
    need: set[int] = set()
    for old, chunks in chunks_of.items():
        for c in chunks:
            box = boxes.get(c.key)
            if box is not None and c.numel and shards.overlap(box[0], box[1], c.offsets, c.sizes):
                need.add(old)
                break
    return need


def snapshot_targets(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Empty DTensors like ``tensors`` (the new sharding) to fill."""
    return {key: torch.empty_like(t) for key, t in tensors.items()}


def own_snapshots(own: Snapshot | None, held: Mapping[int, Snapshot]) -> dict[int, Snapshot]:
    """This rank's snapshots by old rank: its own and the replicas it holds."""
    out = dict(held)
    if own is not None:
        out[own.rank] = own
    return out
