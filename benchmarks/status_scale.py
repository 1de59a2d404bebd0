"""How long `elasticd status --job X --json` takes on a 1,000-node job.

A synthetic job (``tests/synthetic_job.py``, a test fixture) is written into a private etcd on
127.0.0.1 (or the one given with ``--etcd``): node records on a lease, the round state,
join keys, c10d store keys (which status skips), progress, the checkpoint pointer and
256 events. Then we time:

- ``call``: ``elasticd.status.cli.run`` in this process (etcd read + derive + JSON),
  with a fresh client each time, as the command does;
- ``call, table``: the same, rendering the rich screen instead of JSON;
- ``process``: ``python -m elasticd.status ... --json`` as a subprocess, which adds
  interpreter start-up and imports;
- ``process, elasticd``: the installed ``elasticd status`` console script, when present.

It also counts the etcd range requests of one status call. Usage::

    .venv/bin/python benchmarks/status_scale.py --nodes 1000 --repeat 20
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from elasticd.etcd.client import EtcdClient
from elasticd.etcd.embedded import EmbeddedEtcd
from elasticd.status.cli import build_parser, run
from elasticd.status.snapshot import read_job

# The synthetic job is a test fixture, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from synthetic_job import SyntheticJob, write_synthetic_job  # noqa: E402


class CountingClient(EtcdClient):
    """Counts range requests, to show a status call is one read, not one per node."""

    reads = 0

    def get_prefix(self, prefix):  # type: ignore[no-untyped-def]
        self.reads += 1
        return super().get_prefix(prefix)


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    fn()  # warm-up: gRPC channel set-up paths, imports, page cache
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary(name: str, samples: list[float]) -> dict[str, object]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return {"case": name, "n": len(samples), "median_ms": statistics.median(samples) * 1e3,
            "p95_ms": p95 * 1e3, "max_ms": ordered[-1] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--process-repeat", type=int, default=10)
    ap.add_argument("--etcd", help="use this etcd instead of starting a private one")
    ap.add_argument("--out", help="also write the results as JSON here")
    opts = ap.parse_args()

    server = None if opts.etcd else EmbeddedEtcd().start()
    endpoint = opts.etcd or server.endpoint  # type: ignore[union-attr]
    job = f"bench-{opts.nodes}"
    try:
        client = EtcdClient(endpoint, timeout_s=10)
        t0 = time.perf_counter()
        write_synthetic_job(client, SyntheticJob(job, nodes=opts.nodes, lost=2, waiting=3),
                            now=time.time())
        write_s = time.perf_counter() - t0
        kvs, _ = client.get_prefix(f"/elasticd/{job}/")
        payload = sum(len(kv.key) + len(kv.value) for kv in kvs)
        client.close()

        counting = CountingClient(endpoint, timeout_s=10)
        snap = read_job(counting, job)
        counting.close()
        assert snap is not None

        parser = build_parser()
        json_args = parser.parse_args(["status", "--etcd", endpoint, "--job", job, "--json"])
        table_args = parser.parse_args(["status", "--etcd", endpoint, "--job", job])

        def call(args: argparse.Namespace) -> None:
            code = run(args, out=io.StringIO(), err=io.StringIO())
            assert code == 1, code  # two members lost: re-forming (exit 1 since the re-forming state)

        results = [
            summary("call, --json", timed(lambda: call(json_args), opts.repeat)),
            summary("call, table", timed(lambda: call(table_args), opts.repeat)),
        ]
        env = {**os.environ, "COLUMNS": "80"}
        commands = [("process: python -m elasticd.status --json",
                     [sys.executable, "-m", "elasticd.status"])]
        script = shutil.which("elasticd", path=str(Path(sys.executable).parent)) or shutil.which(
            "elasticd")
        if script:
            commands.append(("process: elasticd status --json", [script, "status"]))
        for name, cmd in commands:
            full = [*cmd, "--etcd", endpoint, "--job", job, "--json"]

            def proc(full: list[str] = full) -> None:
                r = subprocess.run(full, capture_output=True, env=env, timeout=60)
                assert r.returncode == 1, r.stderr.decode()

            results.append(summary(name, timed(proc, opts.process_repeat)))
    finally:
        if server is not None:
            server.stop()

    print(f"job: {opts.nodes} members (2 lost), 3 waiting, {len(kvs)} keys, "
          f"{payload / 1e6:.2f} MB read per status call; written in {write_s:.2f} s")
    print(f"etcd range requests per status call: {counting.reads}")
    print()
    print("| case | runs | median (ms) | p95 (ms) | max (ms) |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['case']} | {r['n']} | {r['median_ms']:.0f} | {r['p95_ms']:.0f} | "
              f"{r['max_ms']:.0f} |")
    if opts.out:
        Path(opts.out).write_text(json.dumps({
            "nodes": opts.nodes, "keys": len(kvs), "bytes": payload,
            "range_requests": counting.reads, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
