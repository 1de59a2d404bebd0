"""The agent's writer of the job's progress history (``/elasticd/<job>/history``).

The policy (when a sample is due, how the record stays bounded) is the pure
``elasticd.history.append_sample``; this is the thin etcd part: read the record, append,
write it back with a compare on its mod_revision (two agents never interleave a lost
update) and on this node's incarnation (a zombie writes nothing). An unreadable record is
deleted by whoever reads it, fenced or not (a compare on its own revision only). Best effort like every
record of ``JobRecorder``: a failed or refused write drops the sample, never a step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from elasticd.errors import TransientError
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.txn import Compare, Delete, ModRevision, Put
from elasticd.history import History, Sample, append_sample
from elasticd.keys import JobKeys
from elasticd.records import CheckpointPointer

log = structlog.get_logger(__name__)


class EtcdHistoryWriter:
    """Appends ``Sample`` s to one job's history record, fenced by ``fence``.

    Args:
        client: the agent's etcd client.
        keys: the job's key builder.
        fence: returns the extra compares of every write (the node's incarnation).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys,
                 fence: Callable[[], Sequence[Compare]]) -> None:
        self.client = client
        self.keys = keys
        self.fence = fence
        # Called with the record after each sample written (the goodput metrics).
        self.on_written: Callable[[History], None] | None = None
        self._last_t = 0.0
        self._last_world = -1
        self._interval_s = 0.0  # of the record last seen; skips I/O for samples not yet due
        # The newest step time offered at each world size (a handful of sizes): a sample
        # taken at a resize carries the one of the size before it, the interval it closes.
        self._step_s: dict[int, float] = {}

    def append(self, t: float, step: int, world_size: int, samples_per_s: float, round_: int,
               loss: float | None = None, *, step_s: float = 0.0) -> bool:
        """Append a sample if one is due; returns True when it was written. ``step_s``:
        the workers' median seconds per step lately (0: not measured); the sample carries
        the newest one offered at the previous sample's world size (``Sample.step_s``)."""
        if step_s > 0:
            self._step_s[world_size] = step_s
        if t - self._last_t < self._interval_s and world_size == self._last_world:
            return False  # not due by the record we last saw: no etcd read at all
        try:
            kv = self.client.get(self.keys.history)
            history = History()
            if kv is not None:
                try:
                    history = History.from_json(kv.value)
                except ValueError as exc:
                    # Delete it whether or not this write is due or fenced: only a compare on
                    # the record itself (a valid one written meanwhile stays). A fenced
                    # "replace" left a hostile record in place for every reader after it.
                    self.client.txn([ModRevision(self.keys.history, kv.mod_revision)],
                                    [Delete(self.keys.history)])
                    log.warning("history_record_deleted", error=str(exc)[:200])
                    kv = None
            ptr = self.client.get(self.keys.checkpoint_latest)
            ckpt = None
            if ptr is not None:
                try:
                    ckpt = CheckpointPointer.from_json(ptr.value).step
                except (ValueError, TypeError):
                    ckpt = None
            closes = history.samples[-1].world_size if history.samples else world_size
            new = append_sample(history, Sample(t, step, world_size, samples_per_s, round_, loss,
                                                ckpt, self._step_s.get(closes)))
            if new is None:
                self._remember(history)
                return False
            rev = kv.mod_revision if kv is not None else 0
            ok = self.client.txn([ModRevision(self.keys.history, rev), *self.fence()],
                                 [Put(self.keys.history, new.to_json())])
        except TransientError as exc:
            log.warning("history_sample_dropped", error=str(exc))
            return False
        if ok:
            self._remember(new)
            if self.on_written is not None:
                self.on_written(new)
        return bool(ok)

    def _remember(self, history: History) -> None:
        if history.samples:
            self._last_t = history.samples[-1].t
            self._last_world = history.samples[-1].world_size
        self._interval_s = history.interval_s
