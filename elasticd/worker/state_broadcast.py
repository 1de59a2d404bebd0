"""Live re-formation's state broadcast: the structure once, the tensors without copies.

The rank that holds the newest state sends it to the ranks that are behind or new. The
nested state dict is split into a skeleton (pickled, sent through the process group) and
its tensors; CPU tensors on a gloo group then go over plain TCP straight into the
receivers' memory (:mod:`elasticd.worker.transfer`), CUDA tensors through the group's own
broadcast (NCCL).
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch
import torch.distributed as dist

import elasticd.worker.context as wctx
from elasticd.worker.sockets import group_endpoints
from elasticd.worker.transfer import TransferError, TransferSource, byte_view, receive

log = structlog.get_logger(__name__)

BIG_TENSOR_BYTES = 1 << 20  # tensors this large are broadcast alone; smaller ones per dtype, flat


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by its index in ``tensors`` (appended)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return ("__t__", len(tensors) - 1, tuple(obj.shape), str(obj.dtype).split(".")[-1])
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return ("__tuple__", [_split(v, tensors) for v in obj])
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, tuple) and obj and obj[0] == "__t__":
        return tensors[obj[1]]
    if isinstance(obj, tuple) and obj and obj[0] == "__tuple__":
        return tuple(_join(v, tensors) for v in obj[1])
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def _metas(obj: Any, out: list[tuple[tuple[int, ...], str]]) -> None:
    if isinstance(obj, tuple) and obj and obj[0] == "__t__":
        out.append((obj[2], obj[3]))
    elif isinstance(obj, tuple) and obj and obj[0] == "__tuple__":
        for v in obj[1]:
            _metas(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _metas(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _metas(v, out)


def _destinations(skeleton: Any, local: Any, out: dict[int, torch.Tensor]) -> None:
    """Map the skeleton's tensor indices to the receiver's own tensors at the same place
    with the same shape and dtype (contiguous, on the CPU): the state is received straight
    into them, with no allocation (a fresh page costs more than its bytes on the wire) and
    nothing left for ``load_state_dict`` to copy."""
    if isinstance(skeleton, tuple) and skeleton and skeleton[0] == "__t__":
        if (isinstance(local, torch.Tensor) and local.device.type == "cpu"
                and local.layout == torch.strided and local.is_contiguous()
                and tuple(local.shape) == tuple(skeleton[2])
                and str(local.dtype).split(".")[-1] == skeleton[3]):
            out[skeleton[1]] = local.detach()
    elif isinstance(skeleton, tuple) and skeleton and skeleton[0] == "__tuple__":
        if isinstance(local, (tuple, list)) and len(local) == len(skeleton[1]):
            for s, loc in zip(skeleton[1], local, strict=True):
                _destinations(s, loc, out)
    elif isinstance(skeleton, dict) and isinstance(local, dict):
        for k, v in skeleton.items():
            if k in local:
                _destinations(v, local[k], out)
    elif isinstance(skeleton, list) and isinstance(local, list) and len(local) == len(skeleton):
        for s, loc in zip(skeleton, local, strict=True):
            _destinations(s, loc, out)


def _transfer_method(method: str, tensors: list[torch.Tensor], device: torch.device) -> str:
    """``"tcp"`` when every tensor is a strided CPU tensor on a gloo group, else ``"collective"``.

    CUDA tensors keep the collective: NCCL moves GPU memory at NVLink/InfiniBand speed
    (GPUDirect), where a socket would add a device-to-host copy on the source and a
    host-to-device copy on every receiver.
    """
    if method not in ("auto", "tcp", "collective"):
        raise ValueError(f"method={method!r}: use 'auto', 'tcp' or 'collective'")
    if method == "collective":
        return method
    cpu = device.type == "cpu" and dist.get_backend() == "gloo" and all(
        t.device.type == "cpu" and t.layout == torch.strided for t in tensors)
    if method == "tcp" and not cpu:
        raise ValueError("method='tcp' needs strided CPU tensors on a gloo group")
    return "tcp" if cpu else "collective"


def _transfer_source(views: list[memoryview]) -> TransferSource | None:
    """A listener on the address our process group uses, admitting only its peers."""
    hosts, peers = group_endpoints(wctx._S.group_sockets)
    if not hosts:  # a group not created through elasticd.worker: its sockets are unknown
        return None
    try:
        return TransferSource(hosts[0], views, allowed_peers=peers)
    except TransferError as exc:
        log.warning("live_transfer_unavailable", reason=str(exc))
        return None


def broadcast_state(sd: dict[str, Any] | None, src: int, device: torch.device, *,
                    receivers: list[int] | None = None, timeout_s: float = 60.0,
                    method: str = "auto", into: Any = None) -> dict[str, Any] | None:
    """Send a nested state dict from ``src`` to ``receivers``: the structure once (pickled,
    through the group), the tensors' bytes without copies.

    CPU tensors on a gloo group go over one TCP connection per receiver, straight into the
    receiver's tensors (:mod:`elasticd.worker.transfer`: 2-3x gloo's broadcast). CUDA
    tensors, and groups whose sockets are unknown, use the group's broadcast: large tensors
    one by one in place, small ones as one flat buffer per dtype.

    Args:
        sd: the state on ``src`` (ignored elsewhere).
        src: global rank that holds it.
        device: where the collective's buffers live (the GPU for NCCL).
        receivers: the ranks that need the state (default: every other rank). Only these
            receive it on the TCP path; the collective reaches every rank.
        timeout_s: bound on the TCP transfer (connecting, sending, the receivers' acks).
        method: ``"auto"``, ``"tcp"`` or ``"collective"`` (benchmarks compare them).
        into: a receiver's own state of the same structure (TCP path): tensors that match
            in place, shape and dtype receive the bytes in place (they are overwritten
            even if the transfer then fails; the caller falls back to a restart).

    Returns:
        The state on ``src`` and on every rank that received it (tensors freshly allocated
        on receivers); None on a rank that was not a receiver of a TCP transfer.

    Raises:
        TransferError: the TCP transfer failed (a peer died, refused, or timed out); a
            collective's own error on the collective path.
    """
    rank = dist.get_rank()
    tensors: list[torch.Tensor] = []
    skeleton = _split(sd, tensors) if rank == src else None
    wanted = sorted(set(range(dist.get_world_size()) if receivers is None else receivers) - {src})
    source: TransferSource | None = None
    if rank == src and _transfer_method(method, tensors, device) == "tcp":
        try:
            source = _transfer_source([byte_view(t) for t in tensors])
        except (RuntimeError, TypeError, ValueError) as exc:  # a dtype with no byte view
            # Raising here would leave the other ranks waiting in the broadcast below.
            log.warning("live_transfer_unavailable", reason=repr(exc)[:200])
        if source is None and method == "tcp":
            raise TransferError("no address of this process group is known to listen on")
    box: list[Any] = [(skeleton, source.ticket if source is not None else None)]
    try:
        dist.broadcast_object_list(box, src=src)
    except BaseException:
        if source is not None:
            source.close()
        raise
    skeleton, ticket = box[0]
    metas: list[tuple[tuple[int, ...], str]] = []
    _metas(skeleton, metas)
    if ticket is None:
        return _broadcast_collective(skeleton, tensors, metas, src, device)
    deadline = time.monotonic() + timeout_s
    if source is not None:
        source.serve(wanted, deadline)
        return _join(skeleton, tensors)
    if rank not in wanted:
        return None
    mine: dict[int, torch.Tensor] = {}
    _destinations(skeleton, into, mine)
    tensors = [mine[i] if i in mine else torch.empty(shape, dtype=getattr(torch, dt))
               for i, (shape, dt) in enumerate(metas)]
    views = [byte_view(t) for t in tensors]
    if sum(v.nbytes for v in views) != ticket.total_bytes:
        raise TransferError(f"the metadata describes {sum(v.nbytes for v in views)} bytes, the "
                            f"source sends {ticket.total_bytes}")
    receive(ticket, rank, views, deadline)
    return _join(skeleton, tensors)


def _broadcast_collective(skeleton: Any, tensors: list[torch.Tensor],
                          metas: list[tuple[tuple[int, ...], str]], src: int,
                          device: torch.device) -> dict[str, Any]:
    """The group's broadcast: large tensors one by one in place, small ones flat per dtype."""
    if dist.get_rank() != src:
        tensors = [torch.empty(shape, dtype=getattr(torch, dt), device="meta") for shape, dt in metas]
    by_dtype: dict[str, list[int]] = {}
    for i, (shape, dt) in enumerate(metas):
        if tensors[i].numel() * tensors[i].element_size() >= BIG_TENSOR_BYTES:
            # Large tensors go as they are: no copy into (and out of) a flat buffer.
            t = tensors[i] if dist.get_rank() == src else torch.empty(shape, dtype=getattr(torch, dt),
                                                                     device=device)
            t = t.to(device).contiguous()
            dist.broadcast(t, src=src)
            tensors[i] = t.to("cpu") if dist.get_rank() != src else tensors[i]
            continue
        by_dtype.setdefault(dt, []).append(i)
    for dt in sorted(by_dtype):
        idx = by_dtype[dt]
        if dist.get_rank() == src:
            flat = torch.cat([tensors[i].reshape(-1).to(device) for i in idx])
        else:
            flat = torch.empty(sum(tensors[i].numel() for i in idx), dtype=getattr(torch, dt),
                               device=device)
        dist.broadcast(flat, src=src)
        if dist.get_rank() != src:
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                tensors[i] = flat[offset:offset + n].view(tensors[i].shape).to("cpu").clone()
                offset += n
    return _join(skeleton, tensors)
