"""Worker for the exactly-once tests: ``ElasticLoop`` over one of the documented pipelines.

A float64 linear model trained with SGD over a dataset that returns each sample's index.
After every optimizer step each rank appends one ledger row to ``--trace``: the step, the
round it trained in, the epoch, the world size and the sample indices it trained. The
pipeline is chosen with ``--pipeline``:

- ``batch-sampler``: ``ElasticSampler`` + ``ElasticBatchSampler`` with a plan made at start
  (``plan_global_batch(G, world size at start, G, allow_uneven=True)``): one loader batch is
  one optimizer step, the global batch is constant.
- ``distributed``: ``ElasticDistributedSampler`` in a ``DataLoader(batch_size=b)``.
- ``distributed-drop-last``: the same with ``DataLoader(drop_last=True)``.
- ``stateful-loader``: the ``batch-sampler`` pipeline in torchdata's ``StatefulDataLoader``
  under ``ElasticStatefulLoader`` (checkpointed as ``"loader"``).
- ``stream``: ``ElasticStream`` over JSON-lines shards of sample indices (written by rank 0
  of the first run, in ``--shard-dir``), one stream item per step, constant global batch.

``--fsdp`` trains a small MLP as FSDP2 (``ShardedModel(..., "fsdp")``, ``sharded=``) instead
of the DDP linear model; with ``--mesh hsdp`` as HSDP (a ``("replicate", "shard")`` mesh,
shard size = processes per node: ``ShardedModel(..., "hsdp")``); ``--model mlp`` is the
same MLP unsharded (the reference run).
``--stale-model`` (with ``--fsdp``) makes the user error of training the module from the
start instead of ``loop.model`` after a live re-formation.

The test controls the pace with a file, never with a step count: while ``--hold`` exists
and holds a number ``S``, the worker trains steps before ``S`` and then waits (appending a
``waiting`` row to ``<trace>.wait`` once per step and round) until the number grows or
the file is removed; it trains ``--epochs`` epochs. Run without an agent (plain ``python``) it is the fault-free
reference at world size 1.

``--sever FILE``: a worker waiting there whose pid ``FILE`` names dies as its peers see a
crash before its agent does: it shuts its process group's connections down (the peers'
next collective fails as on its death), writes ``FILE.done`` and blocks until the test
kills it, so the kill lands while the job re-forms, at a point the test chooses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

import elasticd.worker.context as wctx
from elasticd import worker
from elasticd.data import ElasticStatefulLoader, ElasticStream, Shard
from elasticd.worker.context import current_round
from elasticd.worker.sockets import shutdown_group_connections


class Indexed(Dataset):
    """(index, x, y): the index travels with the sample into the ledger."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=g, dtype=torch.float64)
        self.y = torch.randn(size, 1, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


PIPELINES = ["batch-sampler", "distributed", "distributed-drop-last", "stateful-loader", "stream"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--pipeline", required=True, choices=PIPELINES)
    p.add_argument("--model", choices=["linear", "mlp"], default="linear")
    p.add_argument("--fsdp", action="store_true", help="the mlp as FSDP2 (sharded=)")
    p.add_argument("--mesh", choices=["fsdp", "hsdp"], default="fsdp",
                   help="--fsdp: the mesh (hsdp: replicate x shard, shard = processes per node)")
    p.add_argument("--shard-dir", default="", help="stream: where the shards are (or go)")
    p.add_argument("--stale-model", action="store_true",
                   help="--fsdp: train the module from the start, never loop.model (a user error)")
    p.add_argument("--dataset-size", type=int, default=96)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4, help="per rank (distributed pipelines)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--live", action="store_true")
    p.add_argument("--hold", default="", help="file holding the first step not to train yet")
    p.add_argument("--sever", default="", help="file naming the pid of a worker to sever (see above)")
    p.add_argument("--checkpoint-url", default=os.environ.get("ELASTICD_CHECKPOINT_URL"))
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--trace", required=True)
    p.add_argument("--final-params", default="")
    return p.parse_args()


def _limit(hold: str) -> int | None:
    try:
        with open(hold) as f:
            return int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):  # removed, or caught mid-write: read again
        return None if not os.path.exists(hold) else -1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0  # it changes on a re-formation


def sever_if_named(sever: str) -> None:
    """If ``sever`` names this process: close its group's connections, say so, block until
    killed (the test's SIGKILL is the crash; its peers saw the connections close first)."""
    try:
        with open(sever) as f:
            named = int(f.read().strip())
    except (FileNotFoundError, ValueError):  # not yet, or caught mid-write: look again
        return
    if named != os.getpid():
        return
    # What its death does to the peers: the group's connections close (gloo's abort alone
    # leaves them open), so a peer's next collective fails at once.
    wctx.abort_groups(lambda: True)
    shutdown_group_connections(wctx.group_sockets())
    with open(sever + ".done.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sever + ".done.tmp", sever + ".done")
    threading.Event().wait()  # never set: the test kills this process


def wait_for_release(hold: str, status: str, step: int, epoch: int, sever: str = "") -> None:
    """Wait while the hold file says ``step`` may not be trained yet; say so once."""
    said = False
    while hold:
        if sever:
            sever_if_named(sever)
        limit = _limit(hold)
        if limit is None or step < limit:
            return
        if not said:
            world = dist.get_world_size() if dist.is_initialized() else 1
            with open(status, "a") as f:
                f.write(json.dumps({"waiting": step, "epoch": epoch, "rank": _rank(),
                                    "world_size": world, "round": current_round()}) + "\n")
            said = True
        time.sleep(0.02)  # polling the test's file: the test decides when the job goes on


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _stream_shards(dataset: Indexed, shard_dir: str) -> list[Shard]:
    """Three JSON-lines shards of sample indices (uneven sizes), written once (rank 0 of the
    first run; the others wait for the last one's rename)."""
    n = len(dataset)
    cuts = [0, n // 3 + 1, 2 * n // 3, n]
    paths = [os.path.join(shard_dir, f"shard-{k}.jsonl") for k in range(3)]
    if _rank() == 0 and not os.path.exists(paths[-1]):
        os.makedirs(shard_dir, exist_ok=True)
        for k, path in enumerate(paths):
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps({"id": i}) + "\n" for i in range(cuts[k], cuts[k + 1]))
            os.replace(path + ".tmp", path)
    while not os.path.exists(paths[-1]):
        time.sleep(0.02)  # rank 0 writes them at once: polling for the file it renames last
    return [Shard(f"file://{path}", cuts[k + 1] - cuts[k]) for k, path in enumerate(paths)]


class Lookup:
    """Stream collate: the step's share of ``{"id": i}`` records -> (index, x, y) batches."""

    def __init__(self, dataset: Indexed) -> None:
        self.dataset = dataset

    def __call__(self, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = torch.tensor([r["id"] for r in records], dtype=torch.long)
        return idx, self.dataset.x[idx], self.dataset.y[idx]


def main() -> int:
    args = parse_args()
    ctx = worker.init()  # ctx.rank and ctx.world_size are the start's
    torch.manual_seed(0)
    dataset = Indexed(args.dataset_size)
    if args.fsdp or args.model == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    else:
        model = torch.nn.Linear(8, 1).to(torch.float64)
    sharded = worker.ShardedModel(model, parallelize, args.mesh) if args.fsdp else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state: dict = {"model": model, "optimizer": optimizer}
    batches = None
    if args.pipeline in ("batch-sampler", "stateful-loader"):
        sampler = worker.ElasticSampler(dataset, global_batch_size=args.global_batch, seed=1)
        plan = worker.plan_global_batch(args.global_batch, ctx.world_size, args.global_batch,
                                        allow_uneven=True)
        batches = worker.ElasticBatchSampler(sampler, plan)
        if args.pipeline == "stateful-loader":
            from torchdata.stateful_dataloader import StatefulDataLoader

            loader = ElasticStatefulLoader(
                StatefulDataLoader(dataset, batch_sampler=batches), sampler)
            state["loader"] = loader
        else:
            loader = DataLoader(dataset, batch_sampler=batches)
    elif args.pipeline == "stream":
        sampler = ElasticStream(_stream_shards(dataset, args.shard_dir),
                                       global_batch_size=args.global_batch,
                                       collate=Lookup(dataset))
        loader = DataLoader(sampler, batch_size=None)
    else:
        sampler = worker.ElasticDistributedSampler(dataset, seed=1)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                            drop_last=args.pipeline == "distributed-drop-last")
    loop = worker.ElasticLoop(state, sampler, checkpoint_url=args.checkpoint_url,
                              save_every=args.save_every, live=args.live, sharded=sharded)
    first_epoch = loop.resume()
    ddp = None if sharded is not None else loop.ddp(model)
    with open(args.trace, "a") as trace:
        for epoch in range(first_epoch, args.epochs):
            sampler.set_epoch(epoch)
            for idx, x, y in loop.batches(loader):
                wait_for_release(args.hold, args.trace + ".wait", loop.steps_done, epoch, args.sever)
                with loop.guard():
                    optimizer.zero_grad()
                    net = ddp if ddp is not None else model if args.stale_model else loop.model
                    loss = F.mse_loss(net(x), y)
                    if batches is not None:
                        loss = loss * batches.plan.loss_scale(len(x))
                    loss.backward()
                    optimizer.step()
                    world = dist.get_world_size() if dist.is_initialized() else 1
                    row = {"step": loop.steps_done, "round": current_round(),
                           "epoch": epoch, "world_size": world, "rank": _rank(),
                           "pid": os.getpid(), "idx": idx.tolist()}
                    trace.write(json.dumps(row) + "\n")
                    trace.flush()
    loop.close()
    params = {k: v.full_tensor() if hasattr(v, "full_tensor") else v  # a collective under FSDP
              for k, v in (loop.model if sharded is not None else model).state_dict().items()}
    if args.final_params and _rank() == 0:
        torch.save({k: v.detach().clone() for k, v in params.items()}, args.final_params)
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
