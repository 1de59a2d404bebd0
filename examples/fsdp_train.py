"""elasticd's reference FSDP2 / HSDP training script: examples/train.py, sharded.

The same flags and outputs as examples/train.py (one JSON line per step from rank 0,
``--trace``, ``--final-params``), plus ``--mesh fsdp|hsdp``: the model is sharded with
``fully_shard`` on :func:`elasticd.worker.elastic_mesh` (1-D, or HSDP's ``("replicate",
"shard")`` with one replica per node), with an LR scheduler, under ``elasticd run``:

- every re-formation restarts the workers (the restart path): the new processes build the
  mesh at the new world size, shard the model on it, and the sharded checkpoint is
  resharded into it (model, optimizer moments, scheduler, sampler, RNG);

- resumes from the newest valid checkpoint at any world size (model, optimizer, sampler,
  RNG), and the sampler continues with the next untrained global batch;
- keeps the global batch constant through resizes (gradient accumulation with no_sync);
- stops on a drain at the same step on every rank, saves, exits 0;
- logs one JSON line per step: step, epoch, world_size, samples_trained, loss.

Run it: ``elasticd run --standalone --nnodes 1 --nproc-per-node 2 examples/fsdp_train.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from elasticd import worker
from elasticd.checkpoint import CheckpointManager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402  (examples/train.py: the same flags, data, model and sampler)
from train import load_checkpoint, make_data, make_model, make_sampler  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = train.make_parser()
    p.description = __doc__.splitlines()[0]
    p.add_argument("--mesh", choices=["fsdp", "hsdp"], default="fsdp",
                   help="fsdp: shard over every rank; hsdp: replicate across nodes, shard within")
    p.add_argument("--live", action="store_true",
                   help="keep the shards in memory through a node loss, drain or join (live "
                   "re-formation, worker PIDs unchanged; fsdp reshards in memory, from the "
                   "peer-RAM replicas after a loss); without it every change restarts")
    p.add_argument("--peer-replica-every", type=int, default=worker.DEFAULT_PEER_REPLICA_EVERY,
                   metavar="K", help="fsdp --live over several nodes: refresh each rank's "
                   "host-memory replica of a peer's shards every K steps (a node loss rolls back "
                   "at most K steps); 0: none, a node loss reads the checkpoint")
    p.add_argument("--dcp", action="store_true",
                   help="checkpoint with torch.distributed.checkpoint instead (async_save, "
                   "resharded on load): what a torchrun + DCP script does; the baseline of "
                   "benchmarks/recovery.py --torchrun-script-args=--dcp. Not with --live")
    p.add_argument("--hold-file", help="tests: after each step s, wait while this file names a "
                   "step <= s (a drain or a join still stops the run there)")
    p.add_argument("--poison-file", help="tests: while held, the rank this file names fills "
                   "its first parameter's local shard with NaN once (a silent corruption), "
                   "then writes FILE.done")
    return p.parse_args(argv)


def poison_once(path: str | None, rank: int, model) -> None:
    """Tests (``--poison-file``): NaN into this rank's first local shard, once."""
    if not path or os.path.exists(path + ".done"):
        return
    try:
        with open(path) as f:
            target = int(f.read().strip())
    except (OSError, ValueError):
        return
    if target == rank:
        with torch.no_grad():
            param = next(model.parameters())
            getattr(param, "_local_tensor", param).fill_(float("nan"))
        with open(path + ".done", "w") as f:
            f.write(str(rank))


def held_until_stop(path: str, step: int, device, stop=None, timeout_s: float = 120.0,
                    while_held=None) -> bool:
    """Wait after ``step`` while ``path`` names a step <= ``step`` on any rank (tests: the
    run trains up to a point and waits there for a fault or a join). True when a drain was
    asked for during the wait. A collective: every rank loops the same number of times."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                held = int(f.read().strip() or "-1") <= step
        except (OSError, ValueError):
            held = False
        flag = torch.tensor([1 if held else 0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return False
        if (stop or worker.should_stop)(step):
            return True
        if while_held is not None:
            while_held()
        if time.monotonic() > deadline:
            raise SystemExit(f"held after step {step} by {path} for {timeout_s:.0f} s")
        time.sleep(0.02)


class DcpCheckpoints:
    """The checkpoints of a plain torchrun + DCP script, with the CheckpointManager calls used
    here (``save``, ``close``) and ``load``: ``dcp.async_save`` of ``get_state_dict`` into
    ``<dir>/step-N`` (the previous save is waited for first), and at start ``dcp.load`` +
    ``set_state_dict`` of the newest ``step-N`` whose ``.metadata`` exists (DCP writes it
    last), at any world size: as torchtitan finds its load step."""

    def __init__(self, url: str) -> None:
        self.root = url.removeprefix("file://")
        os.makedirs(self.root, exist_ok=True)
        self._group = dist.new_group(backend="gloo")  # async_save's own collectives
        self._pending = None

    def _state(self, state: dict, step: int) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(state["model"], state["optim"])
        return {"model": msd, "optim": osd, "sched": state["sched"].state_dict(),
                "sampler": state["sampler"].state_dict(), "step": step}

    def save(self, step: int, state: dict, blocking: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        self.close()
        self._pending = dcp.async_save(self._state(state, step), checkpoint_id=f"{self.root}/step-{step:09d}",
                                       process_group=self._group)
        if blocking:
            self.close()

    def close(self) -> None:
        if self._pending is not None:
            self._pending, pending = None, self._pending
            pending.result()

    def load(self, state: dict) -> int:
        """Load the newest complete save into ``state``; its step, or -1 when there is none."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        t0 = time.perf_counter()
        name = [None]
        if dist.get_rank() == 0:
            done = sorted(d for d in os.listdir(self.root)
                          if d.startswith("step-") and os.path.exists(f"{self.root}/{d}/.metadata"))
            name[0] = done[-1] if done else None
        dist.broadcast_object_list(name, src=0)
        if name[0] is None:
            return -1
        sd = self._state(state, -1)
        dcp.load(sd, checkpoint_id=f"{self.root}/{name[0]}")
        set_state_dict(state["model"], state["optim"], model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        state["sched"].load_state_dict(sd["sched"])
        state["sampler"].load_state_dict(sd["sampler"])
        if dist.get_rank() == 0:
            train.emit(event="checkpoint_loaded", step=sd["step"],
                       seconds=round(time.perf_counter() - t0, 3))
        return int(sd["step"])


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Shard each linear layer, then the root (torchtitan's ``parallelize``, for FSDP)."""
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_epochs(args, ctx, step, x, y, model, optim, sched, sampler, plan, trace, log, state,
                 ckpt, live=None) -> int:
    """Train until ``args.steps``; returns the next step. Live: raises ``worker.Reformed``."""
    progress = state["extra"]
    while step < args.steps:
        epoch = sampler.epoch
        whole = make_sampler(args, sampler, world=1) if trace is not None else None
        wholes = whole.iter_steps() if whole is not None else None
        for share in sampler.iter_steps():
            args.steps = train.end_step(args)  # --end-file (tests): the job ends on the test's word
            batch = next(wholes) if wholes is not None else None
            with live.guard() if live is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                sizes = plan.micro_batch_sizes(ctx.rank)
                total, start = 0.0, 0
                for size, sync_ctx in zip(sizes, worker.accumulation_contexts(model, plan), strict=True):
                    idx = torch.tensor(share[start:start + size], dtype=torch.long)
                    start += size
                    with sync_ctx:
                        loss = nn.functional.mse_loss(model(x[idx].to(ctx.device)), y[idx].to(ctx.device))
                        (loss * plan.loss_scale(size)).backward()
                    total += loss.item() * size
                optim.step()
                optim.zero_grad(set_to_none=True)
                sched.step()
                sampler.step()
                progress["step"] = step
                if trace is not None:
                    trace.write(json.dumps({"step": step, "epoch": epoch, "rank": ctx.rank,
                                            "round": ctx.round, "world": ctx.world_size,
                                            "pid": os.getpid(), "time": time.time(),
                                            "idx": list(share), "global": batch,
                                            "lr": sched.get_last_lr()[0],
                                            "accumulation": plan.accumulation_steps}) + "\n")
                    trace.flush()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                mean_loss = round(total / max(len(share), 1), 6)
                if ctx.rank == 0:
                    log(step=step, epoch=epoch, world_size=ctx.world_size,
                        samples_trained=sampler.samples_trained, loss=mean_loss,
                        step_s=round(time.perf_counter() - t0, 4), round=ctx.round)
                worker.report_progress(step, epoch=epoch, samples=(step + 1) * args.global_batch,
                                       loss=mean_loss)
                done = step + 1 >= args.steps
                # Live: a drain or join elsewhere re-forms here (raises Reformed); True only
                # when every rank stops.
                stop_at = live.step_done if live is not None else worker.should_stop
                stop = stop_at(step)
                if not stop and args.hold_file:
                    stop = held_until_stop(args.hold_file, step, ctx.device, stop_at, while_held=lambda:
                                           poison_once(args.poison_file, ctx.rank, model))
                if stop:  # a drain: every rank stops after this step
                    ckpt.save(step, state, blocking=True)  # commit before exiting 0
                    if ctx.rank == 0:
                        log(event="drained", step=step)
                    ckpt.close()
                    worker.fast_exit(0)
                if done or (step + 1) % args.checkpoint_every == 0:
                    ckpt.save(step, state, blocking=done)
                if ctx.under_agent and ctx.world_size < args.hold_below_world and not done:
                    train.hold_until_asked()
            step += 1
            if done:
                break
        else:
            sampler.set_epoch(epoch + 1)  # epoch complete: the next one starts at position 0
    return step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = worker.init()
    dtype = getattr(torch, args.dtype)
    x, y = make_data(args.dataset_size, dtype, args.seed)
    live = sharded = None
    if args.live:
        # Live: the survivors of a node loss or join re-apply parallelize on the new mesh
        # and keep their shards; a joiner receives its shards from a peer.
        sharded = worker.ShardedModel(make_model(dtype, args.seed, args.hidden).to(ctx.device), parallelize,
                                      args.mesh)
        model = sharded.module
    else:
        # The restart path: this process was started for this round's world; shard on its mesh.
        model = parallelize(make_model(dtype, args.seed, args.hidden).to(ctx.device), worker.elastic_mesh(args.mesh))
    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=10, gamma=0.9)
    sampler = make_sampler(args)
    url = args.checkpoint_url or "file://" + os.path.abspath("checkpoints")
    if args.dcp and args.live:
        raise SystemExit("--dcp is the torchrun + DCP baseline: not with --live")
    ckpt = DcpCheckpoints(url) if args.dcp else CheckpointManager(
        url, job=ctx.job or "local", keep_last=args.keep, fence=worker.agent_fence(),
        run_id=ctx.run_id, resume=ctx.resume)
    progress = {"step": 0}
    # The optimizer's momentum buffers are DTensors: saved shard by shard, resharded on load.
    state = {"model": model, "optim": optim, "sched": sched, "sampler": sampler, "extra": progress}
    if sharded is not None:
        live = worker.LiveState(state, checkpoint=ckpt, sharded=sharded,
                                peer_replica_every=args.peer_replica_every)
        resumed_from = live.resume(lambda: load_checkpoint(ckpt, state))
    else:
        resumed_from = ckpt.load(state) if args.dcp else load_checkpoint(ckpt, state)
    step = resumed_from + 1
    log = train.emit
    trace = open(args.trace, "a") if args.trace else None  # noqa: SIM115
    first = True
    while True:
        ctx = worker.current_context()
        model = state["model"]  # live: a new module after each re-formation
        sampler = state["sampler"] = make_sampler(args, state["sampler"])
        plan = worker.plan_global_batch(args.global_batch, ctx.world_size, args.micro_batch)
        if ctx.rank == 0 and first:
            log(event="started", resumed_from=resumed_from if resumed_from >= 0 else None,
                world_size=ctx.world_size, micro_batch=plan.micro_batch_size,
                accumulation=plan.accumulation_steps, mesh=args.mesh)
        first = False
        try:
            step = train_epochs(args, ctx, step, x, y, model, optim, sched, sampler, plan, trace,
                                log, state, ckpt, live)
            break
        except worker.Reformed:
            assert live is not None
            step = live.step + 1  # continue after the newest step any rank completed
            if worker.current_context().rank == 0:
                log(event="reformed", step=live.step, world_size=worker.current_context().world_size,
                    round=worker.current_context().round)
    ctx = worker.current_context()
    model = state["model"]
    ckpt.close()
    # Gathered on every rank (a collective); rank 0 writes them.
    full = {k: v.full_tensor().detach().cpu() for k, v in model.state_dict().items()}
    if args.final_params and ctx.rank == 0:
        torch.save(full, args.final_params)
    if ctx.rank == 0:
        log(event="finished", step=step - 1)
    worker.shutdown()
    return 0


if __name__ == "__main__":
    # Not sys.exit: under plain torchrun the interpreter's teardown can abort (SIGABRT,
    # "terminate called without an active exception") while a gloo thread still releases
    # the last collective; fast_exit skips it. Under elasticd run the launcher does this.
    worker.fast_exit(main())
