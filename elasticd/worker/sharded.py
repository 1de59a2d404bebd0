"""Live re-formation of an HSDP job: the kept shards re-meshed in place, joiners fed shard by shard.

Under HSDP (a ``("replicate", "shard")`` mesh, shard size = processes per node) a node is
a replica: every rank holds the local shards of its shard coordinate, and every intact
replica holds the whole model. When a node is lost, drained or joins, the survivors need
not restart: their local shards are still right for the new mesh as long as the shard
size and each rank's shard coordinate stay the same. :class:`ShardedModel` then

1. builds the mesh of the new world (``elastic_mesh``, a collective: joiners build theirs
   at start, in the same order);
2. re-applies the script's own ``parallelize(module, mesh)`` to a fresh copy of the model
   on the meta device, materialises it (``to_empty``) and copies each kept local shard
   into the new DTensor's local tensor (same coordinate, same local shape);
3. rebuilds the optimizer around its kept state: the same optimizer object (so an LR
   scheduler holding it carries on), its parameter groups pointed at the new parameters,
   each state tensor re-wrapped as a DTensor of the new mesh (step counters kept).

Why a fresh module and not ``fully_shard`` again on the old one: FSDP2 refuses it
("Each distinct composable distributed API can only be applied to a module once"), and
has no public way to un-shard a module. The copy on meta costs no memory until it is
materialised; for a moment a survivor holds its shards twice (old and new).

A joining rank receives each shard from a rank with the same shard coordinate in an
intact replica, point to point through the live transport
(:func:`~elasticd.worker.state_broadcast.broadcast_state`), into its own local tensors:
no storage read. :func:`plan_shard_transfer` decides who keeps, who sends to whom, or why
the job must take the restart path (the shard size would change, or no intact replica
holds a shard); it is pure and unit-tested.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from elasticd.worker.context import group_generation

NOT_HELD = -2  # a rank's step when it holds no state (a joiner, a fresh start)


@dataclass(frozen=True)
class RankShards:
    """What one rank reports before a sharded re-formation.

    Attributes:
        step: the last step it completed (``NOT_HELD``: it holds no state).
        shard_size: the shard dimension of the mesh its shards belong to (0: none).
        coordinate: its shard coordinate on that mesh (-1: none).
    """

    step: int
    shard_size: int
    coordinate: int


@dataclass(frozen=True)
class ShardPlan:
    """Who keeps its shards and who receives them from whom, or why not at all.

    Attributes:
        step: the newest completed step (the state every rank ends with).
        keepers: ranks whose own shards are that state on the new mesh.
        transfers: ``(shard coordinate, source rank, receiver ranks)``, one per
            coordinate that has receivers.
        fallback: why the re-formation cannot keep the shards (take the restart path);
            None when it can.
    """

    step: int
    keepers: frozenset[int] = frozenset()
    transfers: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    fallback: str | None = None


def plan_shard_transfer(ranks: Sequence[RankShards], new_shard_size: int,
                        new_coordinates: Sequence[int]) -> ShardPlan:
    """Decide a sharded re-formation from every rank's report (the same on every rank).

    Args:
        ranks: each new rank's report, by new global rank.
        new_shard_size: the shard dimension of the new mesh.
        new_coordinates: each new rank's shard coordinate on the new mesh.

    Returns:
        A plan; ``fallback`` says why it cannot keep the shards. Nobody holding a state
        (a fresh start) is not decided here: ``step`` is ``NOT_HELD`` and nothing moves.
    """
    newest = max((r.step for r in ranks), default=NOT_HELD)
    if newest == NOT_HELD:
        return ShardPlan(step=NOT_HELD)
    holders = [i for i, r in enumerate(ranks) if r.step == newest]
    sizes = sorted({ranks[i].shard_size for i in holders})
    if sizes != [new_shard_size]:
        return ShardPlan(step=newest, fallback=(
            f"the shard size changes from {', '.join(map(str, sizes))} to {new_shard_size} "
            "(nodes of unequal size, or a different nproc per node): the shards must be "
            "resharded from the checkpoint"))
    keepers = frozenset(i for i in holders if ranks[i].coordinate == new_coordinates[i])
    transfers: list[tuple[int, int, tuple[int, ...]]] = []
    for coord in range(new_shard_size):
        receivers = tuple(i for i, c in enumerate(new_coordinates) if c == coord and i not in keepers)
        if not receivers:
            continue
        sources = [i for i in sorted(keepers) if new_coordinates[i] == coord]
        if not sources:
            return ShardPlan(step=newest, fallback=(
                f"no intact replica holds shard {coord} of {new_shard_size} at step {newest}: "
                "the shards must be resharded from the checkpoint"))
        transfers.append((coord, sources[0], receivers))
    return ShardPlan(step=newest, keepers=keepers, transfers=tuple(transfers))


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory)."""
    memo: dict[int, object] = {}
    for name_t in itertools.chain(module.named_parameters(), module.named_buffers()):
        t = name_t[1]
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a view of its storage), else ``t``."""
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]


def as_dtensor_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``param``'s mesh, placements, global shape and stride."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, device_mesh=param.device_mesh,  # type: ignore[attr-defined]
                              placements=param.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=param.shape, stride=param.stride())


def _shard_dims(mesh: object) -> tuple[int, int]:
    """(shard size, this rank's shard coordinate) on ``mesh``: its last dimension."""
    coordinate = mesh.get_coordinate()  # type: ignore[attr-defined]
    size = int(mesh.size(-1))  # type: ignore[attr-defined]
    return size, (int(coordinate[-1]) if coordinate is not None else -1)


def shard_coordinates(mesh: object) -> list[int]:
    """Every global rank's shard coordinate on ``mesh`` (by global rank)."""
    ranks = mesh.mesh  # type: ignore[attr-defined]
    out = [-1] * int(ranks.numel())
    for index in itertools.product(*(range(n) for n in ranks.shape)):
        out[int(ranks[index])] = int(index[-1])
    return out


def forget_old_meshes() -> None:
    """Clear DTensor's sharding-propagation caches before a new mesh is used.

    A new round's mesh of the same shape compares equal to an old one (DeviceMesh equality
    is ranks, layout and names, not process groups), so a cached output spec hands a new
    DTensor the old mesh: ``to_empty`` then gives the new parameters the old round's mesh,
    and ``full_tensor()`` fails with "Could not resolve the process group registered under
    the name 4" (the old round's group). FSDP's own collectives use the right groups, so
    only DTensor-level collectives (``full_tensor``, ``redistribute``) would notice.
    """
    from torch.distributed.tensor import debug

    debug._clear_python_sharding_prop_cache()
    debug._clear_fast_path_sharding_prop_cache()


def _current_group() -> tuple[object, int]:
    """The process group a mesh is built on, by identity and generation: a group
    reconfigured in place (torch's ``_reconfigure``) is the same object with new peers, so
    identity alone kept a survivor on the old world's mesh (its shards covered half the
    parameters after a shrink)."""
    return dist.group.WORLD, group_generation()


@dataclass
class ShardedModel:
    """An FSDP2 / HSDP model that live re-formation re-meshes in place.

    Build it from the unsharded module: it keeps a meta-device copy, applies
    ``parallelize(module, elastic_mesh(mesh))`` and exposes the sharded module as
    :attr:`module` (build the optimizer on its parameters). Hand it to
    :class:`~elasticd.worker.LiveState` (``sharded=``) or
    :class:`~elasticd.worker.ElasticLoop` (``sharded=``); after each re-formation
    :attr:`module` is a new module (re-read it, e.g. ``model = live.state["model"]``).

    Args:
        module: the model, unsharded (on its device).
        parallelize: the script's own ``parallelize(module, mesh) -> module`` (applies
            ``fully_shard``); re-applied on every new mesh.
        mesh: ``"hsdp"`` (re-formed in place) or ``"fsdp"`` (the shard size changes with
            the world size: every re-formation takes the restart path).
    """

    module: nn.Module
    parallelize: Callable[[nn.Module, object], nn.Module]
    mesh_kind: str = "hsdp"
    mesh: object = field(init=False)
    names: list[str] = field(init=False)
    params: list[torch.Tensor] = field(init=False)
    _world: tuple[object, int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        from elasticd.worker.mesh import elastic_mesh

        self._skeleton = meta_skeleton(self.module)
        self.mesh = elastic_mesh(self.mesh_kind)
        self._world = _current_group()
        self.module = self.parallelize(self.module, self.mesh)
        self._index()

    def _index(self) -> None:
        # The sharded parameters, taken while the module is sharded: after a step that
        # failed mid-forward its attributes may hold unsharded tensors, these never do.
        named = list(self.module.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]

    @property
    def shard_size(self) -> int:
        return _shard_dims(self.mesh)[0]

    @property
    def coordinate(self) -> int:
        return _shard_dims(self.mesh)[1]

    def mesh_for_world(self) -> object:
        """The mesh of the current process group: built now (a collective) when the group
        changed since the last one (a survivor after a re-formation), else the current one."""
        from elasticd.worker.mesh import elastic_mesh

        if self._world == _current_group():
            return self.mesh
        forget_old_meshes()
        return elastic_mesh(self.mesh_kind)

    def local_state(self) -> dict[str, torch.Tensor]:
        """Each parameter's local shard (views: receiving into them writes the shards)."""
        return {n: local_of(p) for n, p in zip(self.names, self.params, strict=True)}

    def load_local_state(self, received: dict[str, object]) -> None:
        """Copy received local shards into this rank's own (those not received in place)."""
        with torch.no_grad():
            for name, own in self.local_state().items():
                value = received[name]
                if not isinstance(value, torch.Tensor) or value.shape != own.shape:
                    raise TypeError(f"received shard {name!r} does not match this rank's shard")
                if value.data_ptr() != own.data_ptr():
                    own.copy_(value)

    def rebuild(self, mesh: object, *, keep: bool, optimizers: Sequence[torch.optim.Optimizer]) -> nn.Module:
        """Re-apply ``parallelize`` on ``mesh`` to a fresh copy; move the kept shards in.

        Args:
            mesh: the new mesh (same shard size).
            keep: copy this rank's local shards (its coordinate is unchanged); else the
                new shards are left uninitialised, for a transfer to fill.
            optimizers: rebuilt in place around their kept state.

        Returns:
            The new module (also :attr:`module`).
        """
        old_module, old_params = self.module, self.params
        old_buffers = dict(old_module.named_buffers())
        device = old_params[0].device if old_params else torch.device("cpu")
        new = self.parallelize(copy.deepcopy(self._skeleton), mesh)
        new.to_empty(device=device)
        self.module, self.mesh, self._world = new, mesh, _current_group()
        self._index()
        if len(self.names) != len(old_params):
            raise RuntimeError("parallelize built a module with other parameters than before")
        mapping = dict(zip(map(id, old_params), self.params, strict=True))
        with torch.no_grad():
            if keep:
                for old, p in zip(old_params, self.params, strict=True):
                    local_of(p).copy_(local_of(old))
            for name, buf in new.named_buffers():
                if name in old_buffers:
                    buf.copy_(local_of(old_buffers[name]))
        for optim in optimizers:
            rekey_optimizer(optim, mapping)
        return new

    def adopt_optimizer_state(self, optim: torch.optim.Optimizer) -> None:
        """After ``optim.load_state_dict`` of local tensors (a joiner): re-wrap each state
        tensor of a parameter's local shape as a DTensor like that parameter."""
        for p in self.params:
            if not _is_dtensor(p) or p not in optim.state:
                continue
            local_shape = local_of(p).shape
            entry = optim.state[p]
            for k, v in list(entry.items()):
                if isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.dim() > 0 and v.shape == local_shape:
                    entry[k] = as_dtensor_like(v, p)


def rekey_optimizer(optim: torch.optim.Optimizer, mapping: dict[int, torch.Tensor]) -> None:
    """Point ``optim`` at new parameters (``id(old) -> new``), keeping its state: each
    DTensor state value becomes a DTensor of the new parameter's mesh around the same
    local tensor; other values (step counters) are kept as they are."""
    old_state = optim.state
    new_state: dict[torch.Tensor, dict[str, object]] = {}
    for group in optim.param_groups:
        old_params = group["params"]
        group["params"] = [mapping[id(p)] for p in old_params]
        for old, new in zip(old_params, group["params"], strict=True):
            if old in old_state:
                new_state[new] = {k: as_dtensor_like(local_of(v), new) if _is_dtensor(v) else v
                                  for k, v in old_state[old].items()}
    optim.state.clear()
    optim.state.update(new_state)


def optimizer_local_state(optim: torch.optim.Optimizer) -> dict[str, object]:
    """``optim.state_dict()`` with every DTensor replaced by its local tensor (to send)."""
    sd = optim.state_dict()
    state = {idx: {k: local_of(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
             for idx, entry in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}
