"""Checkpoint benchmark: how long saves block training, and throughput against the disk.

For each state size (default 256 MiB and 1 GiB of float32 tensors, like a model's
state dict), on file:// in a scratch directory:

- **blocked per save**: time ``CheckpointManager.save`` holds the caller (async), first
  save (allocates staging buffers) and steady state (median of the rest), against a plain
  synchronous ``torch.save`` of the same state to the same file system (with and without
  fsync). Goal: blocked <= 10% of the synchronous save.
- **write throughput**: bytes / background write time (torch.save through fsspec, CRC,
  fsync, manifest) against ``dd conv=fsync`` of the same bytes. Goal >= 70%.
- **read throughput**: ``load_latest`` into a template (read, CRC, weights_only
  deserialise, copy into the tensors) against ``dd of=/dev/null``, both cold (file
  evicted from the page cache with posix_fadvise) and warm. Goal >= 70%.
- **load with the newest three corrupt**: flip a byte in the newest three checkpoints'
  data and time ``load_latest`` (it reads and rejects each before loading the fourth).
- ``--compare-dcp``: torch.distributed.checkpoint save/load of the same state through its
  FsspecWriter/FsspecReader, for the format decision in docs/checkpoints.md.

Run: ``python benchmarks/checkpoint.py [--sizes 256,1024] [--repeats 4] [--dir /tmp]
[--compare-dcp] [--write-docs docs/benchmarks.md]``. It prints a Markdown section; with
``--write-docs`` it replaces (or appends) the "## Checkpoints" section of that file only.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from elasticd.checkpoint import CheckpointManager
from elasticd.checkpoint.manifest import STATE_FILE
from elasticd.logs import configure_logging

MiB = 1 << 20
SECTION = "## Checkpoints"


def _state(size_mib: int, tensors: int = 64) -> dict[str, Any]:
    per = size_mib * MiB // 4 // tensors
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(tensors)}}


def _evict(path: str) -> None:
    """Drop one file's pages from the page cache (no global drop_caches)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _dd(args: list[str]) -> float:
    t, _ = _timed(lambda: subprocess.run(["dd", *args, "bs=16M", "status=none"], check=True))
    return t


def _files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def bench_size(size_mib: int, repeats: int, workdir: str, compare_dcp: bool) -> dict[str, Any]:
    """All measurements for one state size; returns a dict of numbers (seconds, MB/s)."""
    r: dict[str, Any] = {"size_mib": size_mib}
    nbytes = size_mib * MiB
    state = _state(size_mib)

    # Synchronous baseline: what a training loop does without elasticd. Every timed write
    # starts with no dirty pages (os.sync), so one write's writeback never bills another.
    # Medians of `repeats` runs: single runs on a shared machine vary by 2x.
    plain = os.path.join(workdir, "plain.pt")

    def save_plain() -> None:
        torch.save(state, plain)

    def save_fsync() -> None:
        torch.save(state, plain)
        fd = os.open(plain, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    for key, fn in (("sync_s", save_plain), ("sync_fsync_s", save_fsync)):
        times = []
        for _ in range(repeats):
            os.sync()
            times.append(_timed(fn)[0])
        r[key] = statistics.median(times)

    # Physical ceilings: dd of the same bytes (source in the page cache, as elasticd's
    # staged copy is in memory), written with fsync; read cold and warm.
    copy = os.path.join(workdir, "dd.bin")
    _dd([f"if={plain}", "of=/dev/null"])
    writes, colds, warms = [], [], []
    for _ in range(3):
        os.sync()
        writes.append(_dd([f"if={plain}", f"of={copy}", "conv=fsync"]))
        _evict(copy)
        colds.append(_dd([f"if={copy}", "of=/dev/null"]))
        warms.append(_dd([f"if={copy}", "of=/dev/null"]))
        os.remove(copy)
    r["dd_write_s"] = statistics.median(writes)
    r["dd_read_cold_s"] = statistics.median(colds)
    r["dd_read_warm_s"] = statistics.median(warms)
    os.remove(plain)

    # elasticd async saves.
    url = f"file://{workdir}/ckpt"
    mgr = CheckpointManager(url, job="bench", keep_last=repeats + 1)
    blocked, writes, dcp_saves = [], [], []
    for step in range(1, repeats + 1):
        for t in state["model"].values():
            t.add_(1.0)  # the "training step" between saves
        os.sync()
        mgr.save(step, state)
        result = mgr.wait()
        blocked.append(result.blocked_s)
        writes.append(result.write_s)
        if compare_dcp:  # interleaved, so both see the same disk and machine load
            dcp_saves.append(_dcp_save(state, f"{workdir}/dcp"))
            if step < repeats:
                shutil.rmtree(f"{workdir}/dcp")
    mgr.close()
    r["blocked_first_s"] = blocked[0]
    r["blocked_s"] = statistics.median(blocked[1:]) if len(blocked) > 1 else blocked[0]
    r["write_s"] = statistics.median(writes)
    r["bytes"] = nbytes

    # Loads into a template (zeros: memory already touched, like a live model's), cold
    # and warm.
    template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    reader = CheckpointManager(url, job="bench")
    newest = reader.store.list_saves()[0]
    newest_dir = reader.store.save_path(newest.step, newest.save_id)
    colds, warms = [], []
    for _ in range(3):
        for path in _files(newest_dir):
            _evict(path)
        t, loaded = _timed(lambda: reader.load_latest(template))
        assert loaded.step == repeats
        colds.append(t)
        warms.append(_timed(lambda: reader.load_latest(template))[0])
    r["load_cold_s"] = statistics.median(colds)
    r["load_warm_s"] = statistics.median(warms)
    assert torch.equal(template["model"]["layer0.weight"], state["model"]["layer0.weight"])

    # Newest three corrupt: each is read whole and rejected before the fourth loads.
    if repeats >= 4:
        for save in reader.store.list_saves()[:3]:
            path = f"{reader.store.save_path(save.step, save.save_id)}/{STATE_FILE}"
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
        r["load_3corrupt_s"], loaded = _timed(lambda: reader.load_latest(template))
        assert loaded.step == repeats - 3 and len(loaded.skipped) == 3
    reader.close()
    shutil.rmtree(os.path.join(workdir, "ckpt"))

    if compare_dcp:
        r["dcp_save_s"] = statistics.median(dcp_saves)
        r["elasticd_save_s"] = statistics.median(b + w for b, w in zip(blocked, writes, strict=True))
        r["dcp_load_cold_s"] = _dcp_load_cold(state, f"{workdir}/dcp")
        shutil.rmtree(f"{workdir}/dcp")
    return r


def _dcp_save(state: dict[str, Any], path: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    os.sync()
    t, _ = _timed(lambda: dcp.save(state, storage_writer=FsspecWriter(f"file://{path}", sync_files=True),
                                   no_dist=True))
    return t


def _dcp_load_cold(state: dict[str, Any], path: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    for f in _files(path):
        _evict(f)
    t, _ = _timed(lambda: dcp.load(template, storage_reader=FsspecReader(f"file://{path}"), no_dist=True))
    return t


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def render(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The Markdown section for docs/benchmarks.md."""
    lines = [
        SECTION,
        "",
        f"`python benchmarks/checkpoint.py --sizes {args.sizes} --repeats {args.repeats} "
        f"--threads {args.threads}" + (" --compare-dcp" if args.compare_dcp else "") + "` on "
        f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other work: load average "
        f"{os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}, file:// on the "
        "local disk. Single process; state = 64 float32 tensors.",
        "",
        "Blocked = time `CheckpointManager.save` holds the training loop (async: staging copy "
        "into reused host buffers; the first save also allocates them); sync = plain "
        "`torch.save` of the same state to the same file system, which returns once the bytes "
        "are in the page cache, and the same followed by fsync (what the async save does in "
        "the background). Medians. Goal: blocked <= 10% of sync.",
        "",
        "| state | sync torch.save | sync + fsync | blocked, first save | blocked, steady | "
        "blocked / sync | blocked / (sync + fsync) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['size_mib']} MiB | {r['sync_s']:.3f} s | {r['sync_fsync_s']:.3f} s | "
            f"{r['blocked_first_s']:.3f} s | {r['blocked_s']:.3f} s | "
            f"{100 * r['blocked_s'] / r['sync_s']:.1f}% | "
            f"{100 * r['blocked_s'] / r['sync_fsync_s']:.1f}% |")
    lines += [
        "",
        "Throughput (medians) through file:// against `dd bs=16M` of the same bytes (write: from the "
        "page cache, `conv=fsync`; read: to /dev/null, cold = file evicted from the page "
        "cache with posix_fadvise first). elasticd's write is "
        "torch.save + CRC-32 + fsync + manifest in the background; its read is "
        "`load_latest` into a template: read + CRC + weights_only load + copy. Goal >= 70%.",
        "",
        "| state | write | dd write | write / dd | read cold | dd read cold | cold / dd | "
        "read warm | dd read warm | warm / dd |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n = r["bytes"]
        w, dw = _mbps(n, r["write_s"]), _mbps(n, r["dd_write_s"])
        rc, drc = _mbps(n, r["load_cold_s"]), _mbps(n, r["dd_read_cold_s"])
        rw, drw = _mbps(n, r["load_warm_s"]), _mbps(n, r["dd_read_warm_s"])
        lines.append(
            f"| {r['size_mib']} MiB | {w:.0f} MB/s | {dw:.0f} MB/s | {100 * w / dw:.0f}% | "
            f"{rc:.0f} MB/s | {drc:.0f} MB/s | {100 * rc / drc:.0f}% | {rw:.0f} MB/s | "
            f"{drw:.0f} MB/s | {100 * rw / drw:.0f}% |")
    if any("load_3corrupt_s" in r for r in results):
        lines += ["", "Load of the newest valid checkpoint when the newest three are corrupt "
                      "(flipped byte in each data file: each is read whole, fails its CRC, "
                      "and is skipped with a logged reason):", "",
                  "| state | load, newest valid | load, newest three corrupt |", "|---|---|---|"]
        for r in results:
            if "load_3corrupt_s" in r:
                lines.append(f"| {r['size_mib']} MiB | {r['load_cold_s']:.2f} s (cold) | "
                             f"{r['load_3corrupt_s']:.2f} s |")
    if any("dcp_save_s" in r for r in results):
        lines += ["", "Format decision: torch.distributed.checkpoint (FsspecWriter, "
                      "sync_files, one process) on the same state, saves interleaved with "
                      "elasticd's (median; elasticd = blocked + background write, CRC and "
                      "manifest included); cold loads into the same template:", "",
                  "| state | DCP save | elasticd save (blocked + write) | DCP load cold | "
                  "elasticd load cold |", "|---|---|---|---|---|"]
        for r in results:
            if "dcp_save_s" in r:
                lines.append(f"| {r['size_mib']} MiB | {r['dcp_save_s']:.2f} s | "
                             f"{r['elasticd_save_s']:.2f} s | "
                             f"{r['dcp_load_cold_s']:.2f} s | {r['load_cold_s']:.2f} s |")
    lines.append("")
    return "\n".join(lines)


def write_section(path: str, section: str) -> None:
    """Replace the "## Checkpoints" section of ``path`` (or append it); other sections stay."""
    text = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == SECTION), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = "".join(lines[:start]) + section + ("\n" if end < len(lines) else "") + "".join(lines[end:])
    with open(path, "w") as f:
        f.write(new if new.endswith("\n") else new + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256,1024", help="state sizes in MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=4, help="saves per size (>= 4 for the corrupt test)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--compare-dcp", action="store_true", help="also time torch.distributed.checkpoint")
    p.add_argument("--write-docs", metavar="FILE", help="write the section into this Markdown file")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1, as torchrun sets OMP_NUM_THREADS "
                        "for its workers; on a busy machine more threads spin and stall copies)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    configure_logging("json", level="warning")
    workdir = tempfile.mkdtemp(prefix="elasticd-ckpt-bench-", dir=args.dir)
    results = []
    t0 = time.perf_counter()
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            print(f"benchmarking {size} MiB...", file=sys.stderr, flush=True)
            results.append(bench_size(size, max(2, args.repeats), workdir, args.compare_dcp))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    section = render(results, args)
    print(section)
    print(f"(total {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.write_docs:
        write_section(args.write_docs, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
