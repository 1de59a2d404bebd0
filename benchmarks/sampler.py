"""What ElasticSampler's iteration costs on a large dataset, next to torch's DistributedSampler.

For each case a fresh Python process builds the sampler and starts iterating; we report

- ``first_index_ms``: from ``iter(sampler)`` to the first index (what a restart waits for),
- ``per_index_ns``: mean cost of each following index over ``--indices`` indices,
- ``epoch_share_s``: that cost extrapolated to this rank's whole epoch,
- ``peak_rss_mb``: the process's peak resident memory growth while doing it (VmHWM after
  resetting it post-import; ru_maxrss-based if the kernel cannot reset it).

Cases (``--n`` samples, global batch ``--global-batch``): ElasticSampler at world size 8
(rank 3) and 1, with shuffle and without, and DistributedSampler at world size 8 (it
materialises ``torch.randperm(n).tolist()`` on every rank, every epoch).

    .venv/bin/python benchmarks/sampler.py                  # 100M samples, markdown table
    .venv/bin/python benchmarks/sampler.py --json --repeat 3
    .venv/bin/python benchmarks/sampler.py --baseline-n 0   # skip DistributedSampler (~5 GB)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak() -> bool:
    # Writing 5 to clear_refs resets VmHWM (Linux >= 4.0), so the peak excludes imports.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def run_case(case: str, n: int, global_batch: int, indices: int) -> dict[str, float | int | str]:
    """Measure one case in this process (called in a child process by main())."""
    import torch
    from torch.utils.data import DistributedSampler

    sys.path.insert(0, str(ROOT))
    from elasticd.data.sampler import ElasticSampler

    torch.set_num_threads(1)  # like a DataLoader main process competing with training
    world, rank = (1, 0) if case.endswith("w1") else (8, 3)
    base_kb = _status_kb("VmRSS")
    exact_peak = _reset_peak()
    if case.startswith("elastic"):
        sampler = ElasticSampler(
            n,
            global_batch_size=global_batch,
            num_replicas=world,
            rank=rank,
            shuffle="noshuffle" not in case,
        )
        share_len = len(sampler)
    else:
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True)
        share_len = len(sampler)
    t0 = time.perf_counter()
    it = iter(sampler)
    next(it)
    t1 = time.perf_counter()
    count = min(indices, share_len - 1)
    for _ in range(count):
        next(it)
    t2 = time.perf_counter()
    per_index_ns = (t2 - t1) / max(count, 1) * 1e9
    peak_kb = _status_kb("VmHWM")
    return {
        "case": case,
        "n": n,
        "world_size": world,
        "first_index_ms": (t1 - t0) * 1e3,
        "per_index_ns": per_index_ns,
        "epoch_share_s": (t1 - t0) + per_index_ns * share_len / 1e9,
        "peak_rss_mb": max(0, peak_kb - base_kb) / 1024,
        "peak_exact": exact_peak,
    }


def _child(case: str, n: int, global_batch: int, indices: int) -> dict[str, float | int | str]:
    cmd = [sys.executable, "-W", "ignore", __file__, "--child", case, "--n", str(n)]
    cmd += ["--global-batch", str(global_batch), "--indices", str(indices)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000_000, help="dataset size")
    parser.add_argument("--baseline-n", type=int, default=100_000_000, help="0 skips it")
    parser.add_argument("--global-batch", type=int, default=4096)
    parser.add_argument("--indices", type=int, default=2_000_000, help="indices timed per case")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case (median kept)")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child, args.n, args.global_batch, args.indices)))
        return
    cases = [
        ("elastic-w8", args.n),
        ("elastic-w1", args.n),
        ("elastic-noshuffle-w8", args.n),
    ]
    if args.baseline_n:
        cases.append(("distributed-w8", args.baseline_n))
    rows = []
    for case, n in cases:
        runs = [_child(case, n, args.global_batch, args.indices) for _ in range(args.repeat)]
        row = dict(runs[0])
        for key in ("first_index_ms", "per_index_ns", "epoch_share_s", "peak_rss_mb"):
            row[key] = statistics.median(float(r[key]) for r in runs)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if args.json:
        return
    print(
        f"global batch {args.global_batch}, {args.indices:,} indices timed, median of {args.repeat}"
    )
    print("| case | n | first index (ms) | per index (ns) | rank's epoch (s) | peak RSS (MB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['case']} | {r['n']:,} | {r['first_index_ms']:.1f} | {r['per_index_ns']:.0f} "
            f"| {r['epoch_share_s']:.1f} | {r['peak_rss_mb']:.0f} |"
        )


if __name__ == "__main__":
    main()
