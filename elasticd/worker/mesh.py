"""The device mesh of a sharded (FSDP2 / HSDP) job, built for the current world.

On the restart path every re-formation starts new worker processes at the new world
size; :func:`elastic_mesh` builds the mesh those processes shard on, so a script's own
``parallelize(model, mesh)`` (torchtitan's name for the function that applies
``fully_shard``) re-applies the sharding on the new mesh and ``ElasticLoop.resume()`` /
``CheckpointManager.load_latest`` reshard the checkpoint into it.

- ``"fsdp"``: one dimension ``("shard",)`` over every rank.
- ``"hsdp"``: ``("replicate", "shard")``, shard size = processes per node (a node is a
  replica; shards stay on the node's fast links), replicate size = number of nodes.
"""

from __future__ import annotations

from typing import Any

from elasticd.errors import ConfigError
from elasticd.worker.context import current_context

MESH_KINDS = ("fsdp", "hsdp")


def mesh_shape(kind: str, world_size: int, local_world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, dimension names) of a ``kind`` mesh over ``world_size`` ranks.

    Raises:
        ConfigError: unknown kind, or ``hsdp`` over nodes of unequal size.
    """
    if kind == "fsdp":
        return (world_size,), ("shard",)
    if kind == "hsdp":
        if local_world_size < 1 or world_size % local_world_size:
            raise ConfigError(
                f"an hsdp mesh needs the same number of processes on every node: world size "
                f"{world_size} is not a multiple of {local_world_size} per node; use --mesh fsdp "
                "or equal --nproc-per-node everywhere")
        return (world_size // local_world_size, local_world_size), ("replicate", "shard")
    raise ConfigError(f"mesh kind {kind!r} is not one of {', '.join(MESH_KINDS)}")


def elastic_mesh(kind: str = "fsdp") -> Any:
    """``init_device_mesh`` for this round's world (call after ``elasticd.worker.init()``).

    Returns:
        A ``torch.distributed.device_mesh.DeviceMesh`` on ``cuda`` with NCCL, else ``cpu``.

    Raises:
        ConfigError: as :func:`mesh_shape`.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ctx = current_context()
    if not dist.is_initialized() and ctx.world_size == 1:
        # ``python script.py`` with no launcher: FSDP2 still needs a group, of one process.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    shape, names = mesh_shape(kind, ctx.world_size, ctx.local_world_size)
    device = "cuda" if ctx.device.type == "cuda" else "cpu"
    return init_device_mesh(device, shape, mesh_dim_names=names)
