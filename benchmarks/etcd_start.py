"""The embedded etcd's start: etcd's default raft timing beside the lone member's own.

Why: a single-member etcd elects itself when its election timer first fires. With etcd's
defaults (heartbeat 100 ms, election timeout 1,000 ms, randomised up to twice that, less
the tick advance) that cost every ``--standalone`` start, every restart after an outage and
every test fixture 0.4-1.1 s; the embedded etcd now runs a lone member at 10 ms / 100 ms
(:data:`elasticd.etcd.embedded.SINGLE_MEMBER_HEARTBEAT_MS`). This starts the same
``EmbeddedEtcd`` ``--starts`` times with each timing, interleaved, and reports the time
from spawn to the first answered request (``start()``), and a restart on the kept data dir.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/etcd_start.py --starts 10

Only 127.0.0.1; every etcd it starts is stopped and its data dir removed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import structlog

from benchmarks.common import machine_info
from elasticd.etcd.embedded import EmbeddedEtcd

ETCD_DEFAULTS = ("100", "1000")  # etcd's own --heartbeat-interval / --election-timeout, ms


class _DefaultTiming(EmbeddedEtcd):
    """The embedded etcd with etcd's own raft timing (the baseline)."""

    def _command(self) -> list[str]:
        cmd = super()._command()
        for flag, value in zip(("--heartbeat-interval", "--election-timeout"), ETCD_DEFAULTS, strict=True):
            cmd[cmd.index(flag) + 1] = value
        return cmd


def _time_start_and_restart(cls: type[EmbeddedEtcd]) -> tuple[float, float]:
    server = cls(tempfile.mkdtemp(prefix="etcd-start-"))
    try:
        t0 = time.perf_counter()
        server.start()
        started = time.perf_counter() - t0
        server.stop()
        t0 = time.perf_counter()
        server.start()
        return started, time.perf_counter() - t0
    finally:
        server.stop(remove_data=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=10, help="starts (and restarts) per timing")
    args = p.parse_args(argv)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout: the JSON
    runs: dict[str, list[tuple[float, float]]] = {"etcd defaults": [], "lone member": []}
    for _ in range(args.starts):  # interleaved: a neighbour's load falls on both alike
        runs["etcd defaults"].append(_time_start_and_restart(_DefaultTiming))
        runs["lone member"].append(_time_start_and_restart(EmbeddedEtcd))
    out: dict[str, object] = {"machine": machine_info(), "starts": args.starts}
    for name, rows in runs.items():
        starts, restarts = [r[0] for r in rows], [r[1] for r in rows]
        out[name] = {"start_s_median": round(statistics.median(starts), 3),
                     "start_s_range": [round(min(starts), 3), round(max(starts), 3)],
                     "restart_s_median": round(statistics.median(restarts), 3),
                     "restart_s_range": [round(min(restarts), 3), round(max(restarts), 3)]}
    base, ours = out["etcd defaults"], out["lone member"]
    assert isinstance(base, dict) and isinstance(ours, dict)
    out["ratio_start"] = round(ours["start_s_median"] / base["start_s_median"], 3)
    out["ratio_restart"] = round(ours["restart_s_median"] / base["restart_s_median"], 3)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
