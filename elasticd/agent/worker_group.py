"""The worker group as live re-formation sees it: rejoin the next round, workers running.

torch's ``SimpleElasticAgent._rendezvous`` assigns the next round's ranks by replacing
``WorkerGroup.workers`` with new ``Worker`` objects whose ``id`` is None (torch sets ids
only when it starts processes). Its ``LocalElasticAgent._monitor_workers`` matches those
ids against the running processes' pids and reports ``UNKNOWN`` on a mismatch. A live
re-formation keeps the processes, so after the rendezvous each new ``Worker`` gets the pid
of the process of its local rank back: that step lives here, in one place, and
``tests/unit/test_torch_contract.py`` pins the torch behaviour it relies on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

from torch.distributed.elastic.agent.server.api import WorkerGroup

from elasticd.control.reform import ReformOrder


class TorchWorkerGroup:
    """:class:`~elasticd.agent.reform.WorkerGroupPort` over torch's ``WorkerGroup``.

    Args:
        group: the agent's worker group (torch's, updated in place by the rendezvous).
        rendezvous: runs the next round for ``group`` (the agent's join: torch's
            ``_rendezvous`` with elasticd's commit flush and node state around it).
        pids: the running worker processes' pids by local rank (torch's process context).
        current_round: the rendezvous round the last join formed (the handler's).
    """

    def __init__(self, group: WorkerGroup, rendezvous: Callable[[WorkerGroup], None],
                 pids: Callable[[], Mapping[int, int]],
                 current_round: Callable[[], int | None]) -> None:
        self.group = group
        self._rendezvous = rendezvous
        self._pids = pids
        self._current_round = current_round

    @property
    def local_world_size(self) -> int:
        return int(self.group.spec.local_world_size)

    def rejoin_keeping_workers(self) -> ReformOrder:
        """Run the next round, give each new ``Worker`` its running process's pid back,
        and return the order that tells the workers their new ranks."""
        pids = dict(self._pids())
        self._rendezvous(self.group)
        for w in self.group.workers:  # torch's monitor matches workers to processes by id
            w.id = pids.get(w.local_rank)
        wg = self.group
        if wg.master_addr is None or wg.master_port is None:
            raise RuntimeError("the rendezvous returned no bootstrap address: the order cannot name it")
        return ReformOrder(round=self._round(), world_size=int(wg.workers[0].world_size),
                           master_addr=str(wg.master_addr), master_port=int(wg.master_port),
                           ranks={w.local_rank: w.global_rank for w in wg.workers})

    def _round(self) -> int:
        rnd = self._current_round()
        if rnd is None:
            raise RuntimeError("the rendezvous returned without a round: the order cannot name it")
        return int(rnd)


def drop_torn_error_files(error_files: Mapping[int, str]) -> list[int]:
    """Remove each worker error file that is not valid JSON; returns their local ranks.

    Why: torch's ``ErrorHandler`` truncates a worker's error file, then writes it, and
    torch's ``ProcessFailure`` parses it without catching a ``JSONDecodeError``. A worker
    stopped in between (two workers' ``ConfigError``: the group's stop reached the second
    while it wrote) left it empty, and the agent died with a traceback instead of exiting 78
    (a fresh-clone run). Without the file torch reports the failure by its exit status,
    which is what the policy reads.
    """
    dropped = []
    for local_rank, path in error_files.items():
        try:
            with open(path) as fh:
                json.load(fh)
        except OSError:
            continue  # none (a signal, no error) or unreadable: torch handles that itself
        except ValueError:  # what torch's parse raises uncaught, invalid UTF-8 included
            try:
                os.unlink(path)
            except OSError:
                continue
            dropped.append(local_rank)
    return dropped
