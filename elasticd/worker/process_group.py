"""The worker's process-group lifecycle: form, leave and re-form a group, leaking nothing.

A live re-formation (:mod:`elasticd.worker.live`) leaves the old round's group and joins
the new round's. This module is the one owner of how: a small protocol,
:class:`GroupLifecycle`, with two implementations beside it.

- :class:`RebuildLifecycle` (every torch we support): abort the old group (peers blocked
  on us fail at once), destroy it, and ``init_process_group`` the new round's. The
  destroyed groups are kept referenced for one re-formation (torch's gloo destructor
  race, :mod:`elasticd.teardown`) and released at the next one, so a worker holds at most
  one dead group: its threads and sockets are where the second re-formation left them,
  however many follow (they grew by 4 threads and 13 fds per re-formation while every
  destroyed group was kept).
- :class:`ReconfigureLifecycle` (torch 2.14+, gloo): torch's own
  ``init_process_group(enable_reconfigure=True)`` and ``distributed_c10d._reconfigure``
  re-point the same group at the new round's peers; nothing is destroyed. The peers
  exchange their reconfigure handles through the new round's TCPStore (the one a worker
  started in that round bootstraps from). NCCL has a reconfigure backend in torch 2.14
  too; it is designed in (``nccl_reconfigure=True``) but off until a GPU run proves it.

Which one a worker uses is a pure decision (:func:`choose_lifecycle`) over the torch in
use, the backend and the job's ``ELASTICD_GROUP_LIFECYCLE`` (every rank of a job runs the
same torch with the same environment, so every rank decides the same): reconfigure for
gloo on torch 2.14+ (DDP, FSDP2 and HSDP alike), rebuild elsewhere and when the job asks
for it. A peer's death is recognised in :mod:`elasticd.worker.failures`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from elasticd import teardown
from elasticd.errors import ConfigError

RECONFIGURE_MIN_TORCH = (2, 14)
HANDLE_PREFIX = "elasticd/reconfigure"


class LifecycleKind(enum.Enum):
    REBUILD = "rebuild"
    RECONFIGURE = "reconfigure"


@dataclass(frozen=True)
class LifecycleChoice:
    """What :func:`choose_lifecycle` decided, and why (logged once per worker)."""

    kind: LifecycleKind
    reason: str


def torch_version(version: str) -> tuple[int, int]:
    """``"2.14.1+cpu"`` -> ``(2, 14)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


class LifecycleRequest(enum.Enum):
    """What a job's ``ELASTICD_GROUP_LIFECYCLE`` asks for."""

    DEFAULT = ""  # unset: reconfigure where torch has it for the backend (gloo), else rebuild
    REBUILD = "rebuild"
    RECONFIGURE = "reconfigure"
    NCCL_RECONFIGURE = "nccl-reconfigure"  # NCCL groups too (experimental, no GPU run yet)


def parse_lifecycle_request(value: str | None) -> LifecycleRequest:
    """The request an ``ELASTICD_GROUP_LIFECYCLE`` value makes (unset or empty: the default).

    Raises:
        ConfigError: a value that is none of them (exit 78: every rank would fail the same).
    """
    try:
        return LifecycleRequest((value or "").strip())
    except ValueError:
        allowed = ", ".join(r.value for r in LifecycleRequest if r.value)
        raise ConfigError(f"ELASTICD_GROUP_LIFECYCLE={value!r} is not one of {allowed}; "
                          "unset it for the default (reconfigure on torch 2.14+ with gloo, "
                          "else rebuild)") from None


def choose_lifecycle(version: tuple[int, int], backend: str, *, has_reconfigure: bool,
                     request: LifecycleRequest = LifecycleRequest.DEFAULT) -> LifecycleChoice:
    """Pick the group lifecycle for a worker (pure).

    Reconfigure in place is the default wherever the torch in use has it for the backend:
    gloo on torch 2.14+ (DDP, FSDP2 and HSDP live re-formations pass on 2.14.1 with it).
    NCCL reconfigures only when asked (``nccl-reconfigure``) until a GPU run proves it;
    ``rebuild`` opts out everywhere.

    Args:
        version: torch's (major, minor).
        backend: the training backend (``"gloo"``, ``"nccl"``).
        has_reconfigure: ``distributed_c10d`` has ``_reconfigure`` (the torch build has it).
        request: what the job's ``ELASTICD_GROUP_LIFECYCLE`` asks for.
    """
    if request is LifecycleRequest.REBUILD:
        return LifecycleChoice(LifecycleKind.REBUILD, "asked for (ELASTICD_GROUP_LIFECYCLE=rebuild)")
    if version < RECONFIGURE_MIN_TORCH or not has_reconfigure:
        return LifecycleChoice(LifecycleKind.REBUILD, f"torch {version[0]}.{version[1]} has no c10d reconfigure")
    if backend == "gloo":
        how = "the default" if request is LifecycleRequest.DEFAULT else "asked for"
        return LifecycleChoice(LifecycleKind.RECONFIGURE, f"gloo on torch 2.14+ ({how})")
    if backend == "nccl" and request is LifecycleRequest.NCCL_RECONFIGURE:
        return LifecycleChoice(LifecycleKind.RECONFIGURE, "nccl reconfigure asked for (experimental)")
    return LifecycleChoice(LifecycleKind.REBUILD, f"no reconfigure for {backend} unless asked "
                           "(ELASTICD_GROUP_LIFECYCLE=nccl-reconfigure, experimental)")


# -- the lifecycles ---------------------------------------------------------------------
@dataclass(frozen=True)
class GroupSpec:
    """The group of one round: this rank in it and the round's bootstrap address."""

    backend: str
    rank: int
    world_size: int
    round: int
    master_addr: str
    master_port: int
    timeout_s: float
    device: torch.device | None = None  # NCCL: the group's device


class GroupLifecycle(Protocol):
    """How a worker forms, leaves and re-forms its default process group.

    Every implementation must: make a peer blocked in a collective with this rank fail at
    once on ``leave`` (never wait on dead peers); after ``join`` leave ``dist.group.WORLD``
    the new round's group with ``get_rank``/``get_world_size`` of the spec; and hold no
    more threads or sockets after the n-th re-formation than after the second.
    """

    kind: LifecycleKind

    def form(self, spec: GroupSpec | None) -> None:
        """Form the first group (``None``: from torchrun's environment, ``env://``)."""

    def leave(self, groups: Iterable[Any], settle: Callable[[], None]) -> None:
        """Abort ``groups`` (the world and the stop group), ``settle()`` our pending work."""

    def join(self, spec: GroupSpec) -> None:
        """Join the new round's group (after ``leave``). Raises on failure within the bound."""


def _abort(groups: Iterable[Any]) -> None:
    for group in {id(g): g for g in groups if g is not None}.values():
        try:
            group.abort()
        except (RuntimeError, AttributeError):  # already aborted, or a backend without it
            pass


def _init_kwargs(spec: GroupSpec | None, backend: str, timeout_s: float,
                 device: torch.device | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if spec is not None:
        kwargs.update(init_method=f"tcp://{spec.master_addr}:{spec.master_port}", rank=spec.rank,
                      world_size=spec.world_size)
    if backend == "nccl" and device is not None:
        kwargs["device_id"] = device
    return kwargs


class RebuildLifecycle:
    """Destroy the old group and initialise the new one; release the group destroyed at
    the re-formation before (see the module doc)."""

    kind = LifecycleKind.REBUILD

    def __init__(self, backend: str, timeout_s: float, device: torch.device | None = None) -> None:
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        self.released = 0  # groups released so far (tests, logs)

    def form(self, spec: GroupSpec | None) -> None:
        dist.init_process_group(**_init_kwargs(spec, self.backend, self.timeout_s, self.device))

    def leave(self, groups: Iterable[Any], settle: Callable[[], None]) -> None:
        if dist.is_initialized():
            _abort(groups)
        settle()
        if dist.is_initialized():
            dist.destroy_process_group()  # kept by elasticd.teardown for one re-formation
        self.released += teardown.release_destroyed()

    def join(self, spec: GroupSpec) -> None:
        dist.init_process_group(**_init_kwargs(spec, spec.backend, spec.timeout_s, spec.device))


INIT_RANK_SPACE = 1 << 16  # gloo's reconfigure names peers by their init rank: unique per member


def assign_init_ranks(held: list[int]) -> list[int]:
    """The init rank of every member of a round (pure): a member keeps the one it holds
    (>= 0); members without one (-1: fresh workers), in rank order, take the smallest free.

    gloo's reconfigure handle carries the rank a process was initialised with, and the
    handles of one reconfigure must be unique; a process keeps its init rank for life.

    Raises:
        ValueError: two members hold the same init rank, or the space is full.
    """
    taken = [r for r in held if r >= 0]
    if len(set(taken)) != len(taken):
        raise ValueError(f"init ranks held twice: {sorted(taken)}")
    free = (r for r in range(INIT_RANK_SPACE) if r not in set(taken))
    try:
        return [r if r >= 0 else next(free) for r in held]
    except StopIteration:
        raise ValueError(f"more than {INIT_RANK_SPACE} members") from None


class _ForwardingStore(dist.Store):
    """The store a reconfigurable group was created with: it forwards to the current
    round's store, so each reconfigure exchanges its peers' addresses there (gloo keeps
    the store it was given at init for life; the first round's host may be long gone)."""

    def __init__(self) -> None:
        super().__init__()
        self.target: Any = None

    def set(self, key: str, value: Any) -> None:
        self.target.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.target.get(key))

    def add(self, key: str, value: int) -> int:
        return int(self.target.add(key, value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self.target.compare_set(key, expected, desired))

    def wait(self, keys: Any, timeout: Any = None) -> None:
        if timeout is None:
            self.target.wait(keys)
        else:
            self.target.wait(keys, timeout)

    def check(self, keys: Any) -> bool:
        return bool(self.target.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self.target.delete_key(key))

    def num_keys(self) -> int:
        return int(self.target.num_keys())

    def set_timeout(self, timeout: Any) -> None:
        self.target.set_timeout(timeout)


class ReconfigureLifecycle:
    """Re-point the same group at the new round's peers with torch's ``_reconfigure``.

    The group is created once, with ``enable_reconfigure=True``, a unique init rank and
    a store that forwards to the current round's TCPStore (the one a worker started in
    that round bootstraps from); each formation (the first included) exchanges init ranks
    and reconfigure handles there, in rank order, under a key of the round, and
    reconfigures with the round as the communicator's uuid. Nothing is destroyed.
    """

    kind = LifecycleKind.RECONFIGURE

    def __init__(self, backend: str, timeout_s: float, device: torch.device | None = None) -> None:
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        self._forward = _ForwardingStore()
        self._init_rank = -1
        self._store: Any = None  # the current round's store (and nothing older)
        self._group_count = 0  # c10d's group counter right after form (a fresh worker's)

    def form(self, spec: GroupSpec | None) -> None:
        if spec is None:
            raise ValueError("ReconfigureLifecycle.form needs the round's GroupSpec")
        store = self._round_store(spec)
        self._exchange_init_ranks(store, spec)
        kwargs: dict[str, Any] = {
            "backend": self.backend, "store": self._forward, "rank": self._init_rank,
            "world_size": INIT_RANK_SPACE, "timeout": timedelta(seconds=self.timeout_s),
            # torch 2.14+: nothing connects here; the communicator forms at the first
            # reconfigure, which makes it the round's group.
            "enable_reconfigure": True}
        if self.backend == "nccl":
            kwargs["device_id"] = self.device
        dist.init_process_group(**kwargs)
        world = dist.distributed_c10d._world
        self._group_count = world.group_count
        self._reconfigure(store, spec)

    def leave(self, groups: Iterable[Any], settle: Callable[[], None]) -> None:
        # Aborting the communicator fails our peers' collectives with us at once; the
        # group object stays and is reconfigured by join.
        _abort(groups)
        settle()

    def join(self, spec: GroupSpec) -> None:
        self._drop_subgroups()
        store = self._round_store(spec)
        self._exchange_init_ranks(store, spec)
        self._reconfigure(store, spec)

    def _drop_subgroups(self) -> None:
        """Destroy the groups made over the old round's group (an HSDP mesh's dimensions,
        the NCCL job's stop group) and count new ones from where a fresh worker does.

        ``new_group`` names a group (and its store keys) by a per-process counter,
        ``_world.group_count``: a survivor that made subgroups in earlier rounds had counted
        further than a joiner, so their next mesh's subgroups met under different names and
        the re-formation hung (the HSDP join on 2.14.1). A rebuild resets the counter by
        destroying every group; here the default group stays. The destroyed subgroups are
        kept referenced until the next re-formation (:mod:`elasticd.teardown`), as a
        rebuild's are.
        """
        c10d = dist.distributed_c10d
        if not dist.is_initialized():
            return
        world, default = c10d._world, c10d._get_default_group()
        subgroups = [g for g in list(world.pg_map) if g is not default]
        teardown.release_destroyed()  # those destroyed at the re-formation before
        _abort(subgroups)
        for group in subgroups:
            dist.destroy_process_group(group)
        world.group_count = self._group_count

    def _round_store(self, spec: GroupSpec) -> Any:
        """The round's TCPStore (rank 0 hosts it, as ``init_process_group`` would)."""
        if spec.rank != 0:
            wait_for_port(spec.master_addr, spec.master_port, time.monotonic() + spec.timeout_s)
        return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, spec.rank == 0,
                             timeout=timedelta(seconds=spec.timeout_s), wait_for_workers=False)

    def _exchange_init_ranks(self, store: Any, spec: GroupSpec) -> None:
        prefix = f"{HANDLE_PREFIX}/{spec.round}/init"
        store.set(f"{prefix}/{spec.rank}", str(self._init_rank))
        held = [int(store.get(f"{prefix}/{r}")) for r in range(spec.world_size)]
        self._init_rank = assign_init_ranks(held)[spec.rank]

    def _reconfigure(self, store: Any, spec: GroupSpec) -> None:
        c10d = dist.distributed_c10d
        prefix = f"{HANDLE_PREFIX}/{spec.round}"
        self._forward.target = dist.PrefixStore(f"{prefix}/pg", store)
        store.set(f"{prefix}/handle/{spec.rank}", c10d._get_reconfigure_handle())  # type: ignore[attr-defined]
        handles = [store.get(f"{prefix}/handle/{r}").decode() for r in range(spec.world_size)]
        work = c10d._reconfigure(uuid=spec.round + 1, handles=handles,  # type: ignore[attr-defined]
                                 timeout=timedelta(seconds=spec.timeout_s))
        work.wait()
        if dist.get_world_size() != spec.world_size or dist.get_rank() != spec.rank:
            raise RuntimeError(f"reconfigured group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                               f"not {spec.rank} of {spec.world_size}")
        # Subgroups (the NCCL job's stop group, FSDP meshes) and the in-memory reshard
        # rendezvous on the default store: make it this round's. The previous round's
        # store, and its server if ours, goes.
        world = c10d._world
        pg = c10d._get_default_group()
        world.pg_map[pg] = (world.pg_map[pg][0], dist.PrefixStore(f"elasticd/{spec.round}", store))
        self._store = store


def has_reconfigure() -> bool:
    """The torch in use has c10d's reconfigure API."""
    c10d = dist.distributed_c10d
    return all(hasattr(c10d, n) for n in ("_reconfigure", "_get_reconfigure_handle"))


def make_lifecycle(choice: LifecycleChoice, backend: str, timeout_s: float,
                   device: torch.device | None) -> GroupLifecycle:
    """The implementation of ``choice``."""
    if choice.kind is LifecycleKind.RECONFIGURE:
        return ReconfigureLifecycle(backend, timeout_s, device)
    return RebuildLifecycle(backend, timeout_s, device)


def wait_for_port(host: str, port: int, deadline: float) -> None:
    """Poll until ``host:port`` accepts a connection (10 ms polls) or ``deadline`` passes.

    The TCPStore client backs off exponentially (seconds) when it connects before the
    new rank 0 listens.
    """
    import socket

    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.01)
