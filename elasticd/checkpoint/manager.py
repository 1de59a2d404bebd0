"""CheckpointManager: the training side of checkpoints (save, load the newest valid, prune).

Design, in the order a save happens (docs/checkpoints.md has the full story):

- **Rank-0 writer.** DDP state is replicated, so group rank 0 writes it all (one
  ``torch.save`` file) while every rank's RNG state is gathered to it. We measured
  torch.distributed.checkpoint too (benchmarks/checkpoint.py --compare-dcp): on one host
  it is no faster, it cannot checksum while writing, and its loader unpickles ``.metadata``
  and non-tensor values with plain pickle, which requirement "never unpickle arbitrary
  objects from storage" rules out.
- **Sharded state** (FSDP2/HSDP DTensors) is the exception: every rank writes its own
  shards from its own background thread (``shards.py``); the writer commits once every
  rank's index is in storage, and a load reshards to the loading run's mesh.
- **Async.** ``save`` blocks only while tensors are copied into reusable host buffers
  (``staging.py``); a background thread writes the data, then the manifest (the commit),
  then asks the fence, then prunes. At most one save is in flight: the next ``save``
  waits for it. Its error is raised by the next ``save``/``wait``/``load_latest``/``close``.
- **Fencing.** With a fence, a written checkpoint counts only once ``fence.commit``
  accepts it. Under an elasticd agent the agent's fence is used by default. The answer has
  three values (:class:`CommitOutcome`): a *refusal* (the fence compared and said no)
  means this worker is a zombie (its round is over) or not newer: the save is deleted and
  :class:`elasticd.errors.FencedError` is raised on the next call. *Unknown* (etcd
  unreachable or slow, no answer from the agent) keeps the save, raises nothing, and
  training goes on: the agent retries the commit and the pointer catches up later.
- **Load.** Group rank 0 picks candidates (the fence pointer first, else the listing,
  newest first), broadcasts each; every rank reads and verifies it and reports back; the
  first candidate every rank could read is applied on all ranks. Torn or corrupt ones are
  skipped with a logged reason; a file pruned mid-read makes everyone list again.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

import elasticd
from elasticd.checkpoint import first_loss, reader, rng
from elasticd.checkpoint import shards as shards_mod
from elasticd.checkpoint.agent_defaults import AUTO_FENCE, AutoFence, agent_identity, resolve_fence
from elasticd.checkpoint.api import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointReadError,
    CheckpointReporter,
    CheckpointSaveError,
    CheckpointSuspectError,
    CommitFence,
    CommitOutcome,
    LoadedCheckpoint,
    SaveResult,
    SkippedCheckpoint,
)
from elasticd.checkpoint.group import make_group
from elasticd.checkpoint.identity import ForeignCheckpointError, RunIdentity
from elasticd.checkpoint.manifest import (
    STATE_FILE,
    FileEntry,
    Manifest,
    checksum,
    new_save_id,
    step_dir_name,
)
from elasticd.checkpoint.pruning import CheckpointPruner
from elasticd.checkpoint.restore import apply, owned, require_safe_torch
from elasticd.checkpoint.retention import PruneDecision, RetentionPolicy, StoredSave
from elasticd.checkpoint.staging import RESERVED_KEY, StateStager, resolve
from elasticd.checkpoint.store import FsspecCheckpointStore
from elasticd.errors import ConfigError, FencedError

log = structlog.get_logger(__name__)

# How often a load lists again when files vanish under it (a prune racing a slow reader).
_MAX_LISTINGS = 5
_RELIST = object()


@dataclass
class _SaveWork:
    """What the background writer of one save needs."""

    inflight: _InFlight
    created_at: float
    event: Any  # CUDA event of the replicated part's copies, or None
    shard_event: Any  # CUDA event of the shard copies, or None
    shards: list[shards_mod.StagedShard] | None  # None: not a sharded save
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class _InFlight:
    """One save between ``save`` and its commit; the thread fills result or error."""

    step: int
    save_id: str
    blocked_s: float
    generation: int = 0  # the manager's group generation when the save began
    thread: threading.Thread | None = None
    result: SaveResult | None = None
    error: BaseException | None = None


class CheckpointManager:
    """Saves and loads one job's checkpoints; call every method on every rank.

    Args:
        url: fsspec URL of the checkpoint root (``file:///shared/ckpt``, ``s3://b/ckpt``,
            ``memory://t``); checkpoints go to ``<url>/<job>/step-<step:012d>/<save_id>/``.
        job: job name (validated: no ``/``, no ``..``).
        rank: this process's rank; default: from the process group, else 0.
        world_size: default: from the process group, else 1.
        keep_last: newest checkpoints kept by pruning (>= 1).
        keep_every: also keep steps that are multiples of this (None: off).
        fence: a :class:`CommitFence`. Default (``AUTO_FENCE``): the agent's fence when
            this process runs under an elasticd agent, else none (the listing decides).
            Pass ``None`` to turn fencing off, or a fence (``MemoryCommitFence``) for tests
            and single-process runs.
        process_group: group to coordinate over; default: the initialised default group,
            or none (single process).
        storage_options: passed to fsspec (e.g. ``{"endpoint_url": ...}`` for S3).
        grace_s: age after which torn or never-committed saves are pruned.
        clock: Unix-time source (tests inject one).
        run_id: this run's id; its saves carry it and only they are loaded and pruned.
            None: the agent's run id under an agent (``ELASTICD_RUN_ID``, like the fence:
            nothing to remember), else anonymous (loads any save).
        resume: what to do with another run's checkpoints: ``"auto"`` (refuse if they are
            all there is), ``"require"`` (resume the newest), ``"never"`` (ignore them).
            Under an agent, ``"auto"`` takes the agent's setting (``--resume``).

    Raises:
        ConfigError: bad URL, job, retention values, run id or resume mode, or
            rank/world_size disagreeing with the process group.
    """

    def __init__(
        self,
        url: str,
        *,
        job: str,
        rank: int | None = None,
        world_size: int | None = None,
        keep_last: int = 3,
        keep_every: int | None = None,
        fence: CommitFence | None | AutoFence = AUTO_FENCE,
        process_group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        grace_s: float = 600.0,
        clock: Callable[[], float] = time.time,
        run_id: str | None = None,
        resume: str = "auto",
    ) -> None:
        if run_id is None:
            run_id, resume = agent_identity(resume)
        self.identity = RunIdentity(run_id, resume)
        try:
            self.policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every, grace_s=grace_s)
        except ValueError as exc:
            raise ConfigError(f"checkpoint retention: {exc}") from exc
        self.store = FsspecCheckpointStore(url, job, storage_options)
        self.job = job
        self.fence = resolve_fence(fence)
        self._group = make_group(process_group, rank, world_size)
        self._generation = 0  # bumped by regroup(): saves begun before it belong to an old round
        self.rank = self._group.rank
        self.world_size = self._group.size
        self._clock = clock
        self._stager = StateStager()
        # How long the committing rank waits for the other ranks' shards of a save.
        self.shard_wait_s = 300.0
        self._abort = threading.Event()
        self._inflight: _InFlight | None = None
        self._last_result: SaveResult | None = None
        self._closed = False
        self._log = log.bind(job=job, rank=self.rank)
        self._pruner = CheckpointPruner(self.store, self.policy, self.identity, self.fence,
                                        clock, self._log)
        # Never pruned by this process: what it last committed and what it loaded.
        self._protect = self._pruner.protect

    def regroup(self, process_group: Any = None) -> None:
        """Coordinate through a new process group from now on (after a live re-formation).

        An asynchronous save still in flight finishes on its own thread (its commit is
        fenced by the round it was taken in); the next save uses the new group's ranks.
        """
        self._group = make_group(process_group, None, None)
        self._generation += 1
        self.rank = self._group.rank
        self.world_size = self._group.size
        self._log = log.bind(job=self.job, rank=self.rank)

    @property
    def is_writer(self) -> bool:
        """True on the rank that writes checkpoints (group rank 0)."""
        return self.rank == 0

    # saving --------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], *, blocking: bool = False) -> None:
        """Save ``state`` as checkpoint ``step``; a collective: call it on every rank.

        Values with ``state_dict()`` (modules, DDP, optimizers, schedulers, samplers)
        are saved through it; RNG states are captured here. Returns once the tensors are
        copied (async) or, with ``blocking=True``, once the checkpoint is committed.

        Args:
            step: training step (0 <= step < 10**12).
            state: e.g. ``{"model": model, "optim": optim, "sampler": sampler,
                "extra": {...}}``.
            blocking: write on the caller's thread and wait for the commit.

        Raises:
            ConfigError: a value that safe loading could not read back (names it).
            CheckpointSaveError: the previous background save failed.
            FencedError: the previous save was refused by the fence (zombie worker).
        """
        t0 = time.perf_counter()
        self._check_open()
        try:
            step_dir_name(step)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self._finish_inflight()  # at most one in flight; raises its error
        # Staging validates too; every rank does it before the collective, so a bad value
        # fails everywhere instead of leaving the other ranks waiting in the gather.
        # Only the writer copies the replicated part; every rank copies its own shards.
        resolved = resolve(state)
        staged, event = self._stager.stage(resolved, copy=self.is_writer and not blocking)
        shards, shard_event = self._stager.stage_shards(resolved, copy=not blocking)
        sharded = next(shards_mod.iter_dtensors(resolved), None) is not None  # the same on every rank
        rng_states = self._group.gather(rng.capture())
        if sharded:
            # Every rank writes into the save's directory, so all must know its name.
            created_at, save_id = self._group.broadcast(
                (now := self._clock(), new_save_id(now)) if self.is_writer else None)
        elif not self.is_writer:
            return
        else:
            created_at = self._clock()
            save_id = new_save_id(created_at)
        inflight = _InFlight(step=step, save_id=save_id, blocked_s=time.perf_counter() - t0,
                             generation=self._generation)
        self._inflight = inflight
        work = _SaveWork(inflight, created_at, event, shard_event, shards if sharded else None)
        if self.is_writer:
            work.payload = dict(staged)
            work.payload[RESERVED_KEY] = {"rng": rng_states}
        target = self._write if self.is_writer else self._write_own_shards
        if blocking:
            target(work)
            self.wait()
            return
        # Not a daemon: if the program ends without close(), the interpreter still waits
        # for the upload instead of leaving a torn checkpoint behind.
        inflight.thread = threading.Thread(target=target, args=(work,),
                                           name=f"elasticd-checkpoint-{step}", daemon=False)
        inflight.thread.start()

    def _write_shards(self, work: _SaveWork) -> list[FileEntry]:
        """Write this rank's shard data file, then its index (published whole)."""
        assert work.shards is not None
        if work.shard_event is not None:
            work.shard_event.synchronize()
        step, save_id = work.inflight.step, work.inflight.save_id
        chunks: list[shards_mod.Chunk] = []

        def write(w: Any) -> None:
            for s in work.shards or ():
                start = w.size
                view = shards_mod.tensor_bytes(s.data)
                w.write(view)
                chunks.append(shards_mod.new_chunk(s.key, s.data.dtype, s.shape, s.offsets,
                                                   s.sizes, start, view))

        data = self.store.write_file(step, save_id, shards_mod.data_name(self.rank), write)
        index = self.store.publish_file(
            step, save_id, shards_mod.index_name(self.rank),
            shards_mod.index_json(self.rank, chunks, data.size, data.crc32))
        return [data, index]

    def _write_own_shards(self, work: _SaveWork) -> None:
        """Background part of a sharded save on a rank that does not commit."""
        try:
            self._write_shards(work)
        except Exception as exc:  # noqa: BLE001 - surfaced on the next call
            url = self.store.save_url(work.inflight.step, work.inflight.save_id)
            work.inflight.error = CheckpointSaveError(
                f"writing rank {self.rank}'s shards of checkpoint step {work.inflight.step} to "
                f"{url} failed: {exc!r}; any earlier checkpoint is left intact")
            work.inflight.error.__cause__ = exc
            self._log.error("checkpoint_save_failed", step=work.inflight.step, url=url,
                            error=repr(exc))

    def _peer_shards(self, step: int, save_id: str, generation: int | None = None) -> list[FileEntry]:
        """The other ranks' shard files, once each has published its index.

        Polls storage (bounded by ``shard_wait_s``): the background writer must not run a
        collective, which would interleave with the training loop's on the same group. A
        save of ``generation`` stops waiting once the group re-forms (:meth:`regroup`): a
        rank lost in that re-formation never writes its shards, and the next save, which
        waits for this one, held the re-formed job for the whole ``shard_wait_s`` (300 s).

        Raises:
            CheckpointSaveError: a rank's index did not appear in time, or the group
                re-formed first (the save stays uncommitted: no manifest).
        """
        entries: list[FileEntry] = []
        deadline = time.monotonic() + self.shard_wait_s
        pause = 0.005
        for rank in range(1, self.world_size):
            name = shards_mod.index_name(rank)
            while True:
                try:
                    data = self.store.read_small(step, save_id, name, shards_mod.MAX_INDEX_BYTES)
                    break
                except FileNotFoundError:
                    if generation is not None and generation != self._generation:
                        raise CheckpointSaveError(
                            f"the group re-formed before rank {rank} wrote its shards of step "
                            f"{step}; not committed (the state lives on in the re-formed group, "
                            "whose next save commits it)") from None
                    if time.monotonic() > deadline:
                        raise CheckpointSaveError(
                            f"rank {rank} did not write its shards of step {step} within "
                            f"{self.shard_wait_s:.0f} s ({name} missing); not committed") from None
                    self._abort.wait(pause)
                    pause = min(pause * 2, 0.25)
            _, size, crc = shards_mod.parse_index(data, name)
            entries += [FileEntry(shards_mod.data_name(rank), size, crc),
                        FileEntry(name, len(data), checksum(data))]
        return entries

    def _write(self, work: _SaveWork) -> None:
        """Background part of a save: data, manifest (commit), fence, prune."""
        inflight, payload, event, created_at = work.inflight, work.payload, work.event, work.created_at
        t0 = time.perf_counter()
        step, save_id = inflight.step, inflight.save_id
        url = self.store.manifest_url(step, save_id)
        try:
            sharded: list[FileEntry] = []
            if work.shards is not None:
                sharded = self._write_shards(work) + self._peer_shards(step, save_id, inflight.generation)
            if event is not None:
                event.synchronize()  # device-to-host copies done
            entry = self.store.write_file(step, save_id, STATE_FILE,
                                          lambda w: torch.save(payload, w))  # type: ignore[arg-type]
            files = (entry, *sharded)
            user = {k: v for k, v in payload.items() if k != RESERVED_KEY}
            manifest = Manifest(
                job=self.job, step=step, save_id=save_id, world_size=self.world_size,
                created_at=created_at, committed_at=self._clock(), files=files,
                parts=tuple(user), sampler=_json_or_none(user.get("sampler")),
                torch_version=torch.__version__, elasticd_version=elasticd.__version__,
                run_id=self.identity.run_id or "",
                shards=tuple(f.name for f in sharded if f.name.endswith(".json")))
            self.store.write_manifest(manifest)
            outcome = (CommitOutcome.COMMITTED if self.fence is None
                       else CommitOutcome.of(self.fence.commit(step, url, self.world_size)))
        except Exception as exc:  # noqa: BLE001 - surfaced on the next call
            inflight.error = CheckpointSaveError(
                f"saving checkpoint step {step} to {url} failed: {exc!r}; any earlier "
                "checkpoint is left intact, check the storage and its credentials")
            inflight.error.__cause__ = exc
            self._log.error("checkpoint_save_failed", step=step, url=url, error=repr(exc))
            return
        nbytes = sum(f.size for f in files)
        write_s = time.perf_counter() - t0
        if outcome is not CommitOutcome.REFUSED:  # a refused upload is deleted: not a save
            self._report_saved(step, inflight.blocked_s + write_s, nbytes)
        inflight.result = SaveResult(step=step, save_id=save_id, manifest_url=url,
                                     nbytes=nbytes, blocked_s=inflight.blocked_s,
                                     write_s=write_s, committed=bool(outcome), outcome=outcome)
        if outcome is CommitOutcome.UNKNOWN:
            # No answer is not a no: keep the bytes (the agent retries the commit, and the
            # pointer catches up once etcd answers), raise nothing, keep training. Protect the
            # save from our own pruning until a newer commit supersedes it.
            self._log.warning("checkpoint_commit_unknown", step=step, url=url)
            self._pruner.remember(manifest)
            self._protect["pending"] = (step, save_id)
            return
        if outcome is CommitOutcome.REFUSED:
            self._log.warning("checkpoint_commit_refused", step=step, url=url)
            inflight.error = FencedError(
                f"checkpoint step {step} was written but the commit fence refused it: this "
                "worker's round is no longer current (or a newer checkpoint is committed). "
                "This worker is a zombie and must stop; its upload was deleted")
            self._pruner.delete(StoredSave(step, save_id, created_at, True), "refused by the commit fence")
            return
        self._pruner.remember(manifest)
        self._protect["saved"] = (step, save_id)
        self._protect.pop("pending", None)
        # The loaded checkpoint was protected as possibly the newest valid one; a fresh
        # commit is newer and known valid, so the old one may age out normally now.
        self._protect.pop("loaded", None)
        self._log.info("checkpoint_saved", step=step, url=url, bytes=entry.size,
                       blocked_s=round(inflight.blocked_s, 4), write_s=round(write_s, 3),
                       mb_per_s=round(nbytes / max(write_s, 1e-9) / 1e6, 1))
        self.prune()

    def _report_saved(self, step: int, seconds: float, nbytes: int) -> None:
        # The agent's fence reports to the agent's metrics (elasticd_checkpoint_save_*).
        if isinstance(self.fence, CheckpointReporter):
            self.fence.saved(step, seconds, nbytes)

    def wait(self) -> SaveResult | None:
        """Block until the in-flight save is committed (the drain before exit).

        Returns:
            The last save's result on the writing rank; None on other ranks or before
            any save.

        Raises:
            CheckpointSaveError: the save failed.
            FencedError: the fence refused it.
        """
        self._finish_inflight()
        return self._last_result

    @property
    def last_saved(self) -> SaveResult | None:
        """The newest save known finished on this rank (its costs: ``blocked_s``,
        ``write_s``), without waiting for the one in flight; None before any, or on a rank
        that does not write."""
        return self._last_result

    def _finish_inflight(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        if inflight.thread is not None:
            t0 = time.perf_counter()
            inflight.thread.join()
            waited = time.perf_counter() - t0
            if waited > 0.01:
                self._log.info("checkpoint_save_waited", step=inflight.step, waited_s=round(waited, 3))
        if (isinstance(inflight.error, (FencedError, CheckpointSaveError))
                and inflight.generation < self._generation):
            # Taken in a round this worker has since left by a live re-formation: the round
            # moved under the commit (fenced), or a rank lost in it never wrote its shards;
            # the state lives on in memory in the new group and the next save commits it.
            # Not a zombie, and not this group's failure.
            self._log.info("checkpoint_commit_superseded", step=inflight.step,
                           reason=f"the group re-formed while the save was in flight: {inflight.error}")
            return
        if inflight.error is not None:
            raise inflight.error
        self._last_result = inflight.result

    def close(self) -> None:
        """Drain the in-flight save and free the staging buffers. Idempotent.

        Raises:
            CheckpointSaveError, FencedError: as :meth:`wait`.
        """
        if self._closed:
            return
        try:
            self._finish_inflight()
        finally:
            self._closed = True
            self._stager.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_exc:  # noqa: BLE001 - keep the original error on top
            self._log.error("checkpoint_close_failed", error=repr(close_exc))

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("CheckpointManager is closed; create a new one to save or load")

    # loading -------------------------------------------------------------------------
    def load_latest(self, template: MutableMapping[str, Any] | None = None) -> LoadedCheckpoint | None:
        """Load the newest valid checkpoint into ``template``; a collective.

        Args:
            template: e.g. ``{"model": model, "optim": optim, "sampler": sampler,
                "extra": extra_dict}``: objects get ``load_state_dict``, tensors and dicts
                are filled in place. None: only return the state.

        Returns:
            The checkpoint loaded (the same on every rank), or None if there is none.
            RNG states are restored (rank r gets saved rank r % saved world size).

        Raises:
            CheckpointMismatchError: the newest valid checkpoint is another job's or does
                not fit the template (names the mismatch).
            CheckpointReadError: storage failed (or memory ran out) while reading: the load
                fails loudly rather than resuming from an older checkpoint.
            ForeignCheckpointError: only another run's checkpoints exist and ``resume`` is
                ``"auto"``; or ``"require"`` found none at all (both exit 78).
            ConfigError: torch older than 2.10 (unsafe ``weights_only``).
        """
        self._check_open()
        require_safe_torch()
        self._finish_inflight()
        t0 = time.perf_counter()
        skipped: list[SkippedCheckpoint] = []
        fresh = [v for v in (template or {}).values()
                 if isinstance(v, torch.optim.Optimizer) and not v.state]
        targets = self._shard_targets(template)
        for _ in range(_MAX_LISTINGS):
            loaded = self._load_once(template, skipped, targets)
            if loaded is not _RELIST:
                if loaded is None:
                    refused = [s for s in skipped if s.suspect]
                    if refused:
                        raise CheckpointSuspectError(
                            f"every checkpoint of job {self.job!r} that would load is marked "
                            f"suspect ({len(refused)}: the first loss after loading each was not "
                            f"finite, newest {refused[0].url}): the loss diverges from any saved "
                            "state, so look at the model, the data or the learning rate; delete "
                            "the suspect.json files to load them again, or start the job afresh "
                            "under a new --checkpoint-url")
                    for optim in fresh:  # nothing loaded: the optimizer starts as given
                        optim.state.clear()
                    self._log.info("checkpoint_not_found", url=self.store.job_url,
                                   skipped=len(skipped))
                    if self.identity.resume == "require":
                        raise ForeignCheckpointError(
                            f"resume='require' but no loadable checkpoint of job {self.job!r} "
                            f"exists under {self.store.job_url} ({len(skipped)} skipped); check "
                            "--checkpoint-url and --job, or drop --resume to start afresh")
                else:
                    seconds = time.perf_counter() - t0
                    self._log.info("checkpoint_loaded", step=loaded.step, url=loaded.manifest_url,
                                   saved_world_size=loaded.world_size, world_size=self.world_size,
                                   skipped=len(skipped), seconds=round(seconds, 3))
                    if isinstance(self.fence, CheckpointReporter):
                        self.fence.loaded(loaded.step, seconds, loaded.nbytes)
                    self._judge_first_loss(loaded)
                return loaded
        raise CheckpointReadError(
            f"checkpoints under {self.store.job_url} kept disappearing while loading "
            f"({_MAX_LISTINGS} listings); is another job pruning the same prefix?")

    @staticmethod
    def _shard_targets(template: Mapping[str, Any] | None) -> shards_mod.ShardTargets | None:
        """The new sharding a sharded checkpoint is read into: the template's DTensors, and
        a fresh optimizer's parameters for the moments it has not created yet."""
        if template is None:
            return None
        return shards_mod.ShardTargets(template, resolve)

    def _load_once(self, template: MutableMapping[str, Any] | None,
                   skipped: list[SkippedCheckpoint], targets: shards_mod.ShardTargets | None) -> Any:
        candidates = None
        if self.is_writer:
            candidates = reader.candidates(
                self.store, self.fence.latest() if self.fence is not None else None,
                lambda url, reason, **how: self._skip(skipped, url, reason, **how), self._log,
                self.identity)
        while True:
            msg: Any = None
            if candidates is not None:
                try:
                    msg = next(candidates)
                except StopIteration:
                    msg = ("none",)
                except ForeignCheckpointError as exc:
                    msg = ("foreign", str(exc))
                except CheckpointMismatchError as exc:
                    msg = ("mismatch", str(exc))
                except Exception as exc:  # noqa: BLE001 - every rank must leave the loop
                    msg = ("failed", f"listing checkpoints under {self.store.job_url} failed: {exc!r}")
            msg = self._group.broadcast(msg)
            if msg[0] == "none":
                return None
            if msg[0] == "relist":
                return _RELIST
            if msg[0] == "foreign":
                raise ForeignCheckpointError(msg[1])
            if msg[0] == "mismatch":
                raise CheckpointMismatchError(msg[1])
            if msg[0] == "failed":
                raise CheckpointReadError(msg[1])
            _, url, manifest = msg
            mapped = self.store.is_local and template is not None
            status, reason, state = reader.read_state(self.store, manifest, mapped, targets)
            reports = self._group.all_gather((status, reason))
            worst = max(s for s, _ in reports)
            if worst == reader.OK:
                return self._apply(template, url, manifest, state, mapped, skipped)
            why = next(r for s, r in reports if s == worst)
            if worst == reader.MISMATCH:
                raise CheckpointMismatchError(f"checkpoint {url}: {why}")
            if worst == reader.FAILED:
                # Storage errors and MemoryError on any rank: not evidence of corruption,
                # so no rank may move on to an older checkpoint.
                raise CheckpointReadError(f"reading checkpoint {url} failed: {why}; "
                                          "storage unreachable? the worker will be retried")
            self._skip(skipped, url, why)
            if worst == reader.VANISHED:
                return _RELIST

    def _apply(self, template: MutableMapping[str, Any] | None, url: str, manifest: Manifest,
               state: dict[str, Any], mapped: bool,
               skipped: list[SkippedCheckpoint]) -> LoadedCheckpoint:
        internal = state.pop(RESERVED_KEY)
        if template is not None:
            missing = shards_mod.unfilled(state)
            if missing:
                raise CheckpointMismatchError(
                    f"checkpoint step {manifest.step} ({url}) holds sharded tensors the "
                    f"template has no DTensor for ({', '.join(missing[:3])}); pass the model and "
                    "optimizer after parallelizing them (fully_shard) on this run's mesh")
            apply(template, state, f"checkpoint step {manifest.step} ({url})", mapped=mapped)
            # What the template took is in the caller's objects; keep only the rest (and
            # drop our references to the mapped file).
            state = {k: owned(v) if mapped else v for k, v in state.items() if k not in template}
        source = rng.restore(list(internal.get("rng") or []), self.rank)
        if source < 0:
            self._log.warning("checkpoint_rng_not_restored", step=manifest.step)
        self._protect["loaded"] = (manifest.step, manifest.save_id)
        return LoadedCheckpoint(step=manifest.step, world_size=manifest.world_size,
                                manifest_url=url, save_id=manifest.save_id,
                                created_at=manifest.created_at, state=state,
                                skipped=tuple(skipped),
                                nbytes=sum(f.size for f in manifest.files))

    def _judge_first_loss(self, loaded: LoadedCheckpoint) -> None:
        """The next loss reported refuses this checkpoint if it is not finite: it is then
        marked suspect and the restart loads the one before (elasticd/checkpoint/first_loss.py)."""
        def refuse(why: str) -> None:
            try:
                self.store.mark_suspect(loaded.step, loaded.save_id, why)
            except Exception as exc:  # noqa: BLE001 - the restart must happen regardless
                self._log.error("checkpoint_mark_suspect_failed", url=loaded.manifest_url,
                                error=repr(exc)[:300])

        first_loss.CHECK.restored(first_loss.Restore(
            f"checkpoint step {loaded.step} ({loaded.manifest_url})", refuse))

    def _skip(self, skipped: list[SkippedCheckpoint], url: str, reason: str, *,
              suspect: bool = False) -> None:
        skipped.append(SkippedCheckpoint(url, reason, suspect))
        if self.is_writer:
            self._log.warning("checkpoint_skipped", url=url, reason=reason)

    # retention -----------------------------------------------------------------------
    def prune(self) -> list[PruneDecision]:
        """Delete checkpoints the retention policy no longer keeps (writer rank only).

        Never raises: a failed prune is logged and retried after the next save.

        Returns:
            What was deleted, with reasons.
        """
        return self._pruner.prune() if self.is_writer else []


def _json_or_none(value: Any) -> dict[str, Any] | None:
    """``value`` if it is a JSON-serialisable dict (the sampler state shown in manifests)."""
    if not isinstance(value, dict):
        return None
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return None
    return value
