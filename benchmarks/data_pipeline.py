"""What the elastic input pipeline costs per step, and how fast a stream resumes mid-shard.

Part 1, per-step overhead (one process, CPU): a small MLP trains on 3x16x16 "images"
augmented in ``--num-workers`` DataLoader workers (random shift, flip and noise), batch 64,
plus ``--sleep-ms`` per step as a stand-in for accelerator time. Four loops alternate in
blocks of ``--block`` steps, rotating the order each round, so load changes hit all alike:

- A: ElasticSampler + ElasticBatchSampler, augmentation from the worker's global RNG;
- B: A plus per-sample seeds (PositionedBatchSampler + SeededDataset: one
  ``torch.Generator`` per sample, keyed by (seed, epoch, position));
- C0: B through torchdata's ``StatefulDataLoader``;
- C: C0 wrapped in ``ElasticStatefulLoader``.

Ratios: B/A is the cost of per-sample seeding, C/C0 that of the adapter.

Part 2, stream resume latency: one shard of ``--records`` samples, stored as fixed 64-byte
records and as JSON lines. After a resize to world size 4, rank 2 resumes at a position
75 % into the shard: time from building the stream to its first step's samples, with the
seekable format (FixedRecordFormat) against the one that reads from the start of the shard
(JsonLinesFormat).

    .venv/bin/python benchmarks/data_pipeline.py                  # markdown
    .venv/bin/python benchmarks/data_pipeline.py --rounds 30 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from elasticd.data import (
    ElasticBatchSampler,
    ElasticSampler,
    ElasticStatefulLoader,
    ElasticStream,
    FixedRecordFormat,
    JsonLinesFormat,
    PositionedBatchSampler,
    SeededDataset,
    Shard,
    plan_global_batch,
    sample_generator,
)

N, BATCH = 4096, 64


def augment(x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Random shift (roll), horizontal flip and noise; ``gen=None`` uses the global RNG."""
    shift = torch.randint(-4, 5, (2,), generator=gen)
    x = torch.roll(x, shifts=(int(shift[0]), int(shift[1])), dims=(1, 2))
    if torch.rand((), generator=gen) < 0.5:
        x = x.flip(2)
    return x + 0.05 * torch.randn(x.shape, generator=gen)


class GlobalRngImages(torch.utils.data.Dataset):
    def __init__(self, base: torch.Tensor) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> torch.Tensor:
        return augment(self.base[i], None)


def _seeded(item: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return augment(item, gen)


def _loaders(base: torch.Tensor, workers: int) -> dict[str, tuple[object, ElasticSampler]]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def sampler() -> tuple[ElasticSampler, ElasticBatchSampler]:
        s = ElasticSampler(N, global_batch_size=BATCH, num_replicas=1, rank=0, seed=0)
        return s, ElasticBatchSampler(s, plan_global_batch(BATCH, 1, BATCH))

    kw = {"num_workers": workers, "prefetch_factor": 4, "persistent_workers": False}
    out: dict[str, tuple[object, ElasticSampler]] = {}
    s, bs = sampler()
    out["A"] = (DataLoader(GlobalRngImages(base), batch_sampler=bs, **kw), s)
    s, bs = sampler()
    out["B"] = (DataLoader(SeededDataset(base, _seeded), batch_sampler=PositionedBatchSampler(bs), **kw), s)
    s, bs = sampler()
    out["C0"] = (StatefulDataLoader(SeededDataset(base, _seeded), batch_sampler=PositionedBatchSampler(bs), **kw), s)
    s, bs = sampler()
    loader = StatefulDataLoader(SeededDataset(base, _seeded), batch_sampler=PositionedBatchSampler(bs), **kw)
    out["C"] = (ElasticStatefulLoader(loader, s), s)
    return out


def overhead(rounds: int, block: int, workers: int, sleep_ms: float) -> dict:
    torch.manual_seed(0)
    base = torch.rand(N, 3, 16, 16)
    model = nn.Sequential(nn.Flatten(), nn.Linear(768, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.set_num_threads(1)  # main-process CPU time then measures the loop, not a thread pool
    loaders = _loaders(base, workers)
    iters = {k: iter(v[0]) for k, v in loaders.items()}
    times: dict[str, list[float]] = {k: [] for k in loaders}
    cpu: dict[str, list[float]] = {k: [] for k in loaders}
    names = list(loaders)
    y = torch.zeros(BATCH, dtype=torch.long)
    for r in range(rounds + 1):  # round 0 warms up (worker start, first batches)
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            loader, s = loaders[name]
            for _ in range(block):
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    x = next(iters[name])
                except StopIteration:
                    s.set_epoch(s.epoch + 1)
                    iters[name] = iter(loader)
                    x = next(iters[name])
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                s.step()
                c1 = time.process_time()
                time.sleep(sleep_ms / 1000)
                if r:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(c1 - c0)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    cpu_ms = {k: statistics.mean(v) * 1000 for k, v in cpu.items()}
    # Main-process cost of what B adds per sample: one key, and (in workers) one generator.
    t0 = time.perf_counter()
    for p in range(20000):
        sample_generator(0, 0, p)
    gen_us = (time.perf_counter() - t0) / 20000 * 1e6
    s = ElasticSampler(N * 16, global_batch_size=BATCH, num_replicas=1, rank=0)
    plan = plan_global_batch(BATCH, 1, BATCH)
    t0 = time.perf_counter()
    plain = sum(len(b) for b in ElasticBatchSampler(s, plan))
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    keyed = sum(len(b) for b in PositionedBatchSampler(ElasticBatchSampler(s, plan)))
    t_keyed = time.perf_counter() - t0
    return {"steps_per_loop": rounds * block, "median_step_ms": med,
            "main_cpu_ms_per_step": cpu_ms,
            "ratio_seeding_B_over_A": med["B"] / med["A"],
            "ratio_adapter_C_over_C0": med["C"] / med["C0"],
            "sample_generator_us": gen_us,
            "batch_sampler_ns_per_index": t_plain / plain * 1e9,
            "positioned_batch_sampler_ns_per_index": t_keyed / keyed * 1e9}


def stream_resume(records: int, repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        fixed, lines = Path(tmp) / "shard.bin", Path(tmp) / "shard.jsonl"
        with open(fixed, "wb") as f:
            for k in range(records):
                f.write(struct.pack("<q", k) + bytes(56))
        with open(lines, "w") as f:
            for k in range(records):
                f.write(json.dumps({"id": k, "text": "x" * 40}) + "\n")
        resume_at = (records * 3 // 4) // 64 * 64
        out = {}
        for name, path, fmt in (("fixed_records_seek_ms", fixed, FixedRecordFormat(64)),
                                ("jsonl_read_from_shard_start_ms", lines, JsonLinesFormat())):
            samples = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                s = ElasticStream([Shard(f"file://{path}", records)], global_batch_size=64,
                                  num_replicas=4, rank=2, format=fmt)
                s.samples_trained = resume_at  # as load_state_dict leaves it after a resize
                first = next(s.iter_steps())
                samples.append((time.perf_counter() - t0) * 1000)
                assert len(first) == 16
            out[name] = statistics.median(samples)
        out["records"], out["resume_offset"] = records, resume_at
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--sleep-ms", type=float, default=15.0)
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = {"overhead": overhead(args.rounds, args.block, args.num_workers, args.sleep_ms),
              "stream_resume": stream_resume(args.records, args.repeat)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    o, r = result["overhead"], result["stream_resume"]
    print(f"| loop ({o['steps_per_loop']} steps each) | median step (ms) | main-process CPU per step (ms) |")
    print("|---|---:|---:|")
    for k, v in o["median_step_ms"].items():
        print(f"| {k} | {v:.2f} | {o['main_cpu_ms_per_step'][k]:.2f} |")
    print(f"\nB/A (per-sample seeding) = {o['ratio_seeding_B_over_A']:.3f}; "
          f"C/C0 (adapter) = {o['ratio_adapter_C_over_C0']:.3f}; "
          f"sample_generator {o['sample_generator_us']:.2f} us; batch sampler "
          f"{o['batch_sampler_ns_per_index']:.0f} ns/index, positioned "
          f"{o['positioned_batch_sampler_ns_per_index']:.0f} ns/index")
    print(f"\nstream resume at offset {r['resume_offset']} of {r['records']}: seek "
          f"{r['fixed_records_seek_ms']:.2f} ms, read from shard start "
          f"{r['jsonl_read_from_shard_start_ms']:.2f} ms")


if __name__ == "__main__":
    main()
