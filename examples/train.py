"""elasticd's reference training script: copy it, replace the model and the data.

A small regression model on synthetic data generated in process (no downloads), trained
with DDP under ``elasticd run`` (or plain ``torchrun``, or ``python examples/train.py``):

- resumes from the newest valid checkpoint at any world size (model, optimizer, sampler,
  RNG), and the sampler continues with the next untrained global batch;
- keeps the global batch constant through resizes (gradient accumulation with no_sync);
- stops on a drain at the same step on every rank, saves, exits 0;
- logs one JSON line per step: step, epoch, world_size, samples_trained, loss.

Run it: ``elasticd run --standalone --nnodes 1 --nproc-per-node 2 examples/train.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from elasticd import worker
from elasticd.checkpoint import CheckpointManager


def emit(**kv: object) -> None:
    """One JSON line on stdout, in one write. Under plain torchrun every rank shares the
    pipe, and ``print`` writes the newline separately when stdout is unbuffered: another
    rank's output could land inside the line."""
    sys.stdout.write(json.dumps(kv) + "\n")
    sys.stdout.flush()


def make_parser() -> argparse.ArgumentParser:
    """The flags (examples/fsdp_train.py adds ``--mesh`` to the same ones)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to train in total")
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step, all ranks")
    p.add_argument("--micro-batch", type=int, default=32, help="max samples per forward pass")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--hidden", type=int, default=64, help="width of the model's hidden layer "
                   "(a larger model: its build, its state transfer and its steps cost more)")
    p.add_argument("--checkpoint-url", default=os.environ.get("ELASTICD_CHECKPOINT_URL"),
                   help="fsspec URL (default: $ELASTICD_CHECKPOINT_URL, else file://./checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="save every N steps (async)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (demos)")
    p.add_argument("--trace", help="append the sample indices each rank trains to this file (tests)")
    p.add_argument("--final-params", help="rank 0 writes the final parameters here (tests)")
    p.add_argument("--hold-below-world", type=int, default=0,
                   help="(tests) under an agent, after each step while the world is smaller, "
                        "wait until this node is asked to stop, park or re-form: a join or a "
                        "stop happens at a known point, not in a race with the job's end")
    p.add_argument("--end-file", help="(tests) once this file holds a step count N, train N steps "
                   "in total (if fewer than --steps): the test ends the job after the phase it "
                   "is about, not with a step count chosen to outlast it")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = make_parser()
    # This script's own (fsdp_train.py, which shares the parser, has a --hold-file of its own).
    p.add_argument("--pause-file", help="(tests) while this file holds a step S, wait before "
                   "training step S or a later one: a fault the test schedules lands inside "
                   "the job, which goes on once the test removes the file")
    return p.parse_args(argv)


def make_data(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same synthetic dataset on every rank: y = tanh(x @ w / 4) + noise."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, 16, generator=g, dtype=dtype)
    w = torch.randn(16, 1, generator=g, dtype=dtype)
    y = torch.tanh(x @ w / 4) + 0.05 * torch.randn(n, 1, generator=g, dtype=dtype)
    return x, y


def make_model(dtype: torch.dtype, seed: int, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(dtype)


def make_sampler(args: argparse.Namespace, old: worker.ElasticSampler | None = None,
                 world: int | None = None) -> worker.ElasticSampler:
    """The sampler for the current world size (or ``world``), at ``old``'s position (if given)."""
    sampler = worker.ElasticSampler(args.dataset_size, global_batch_size=args.global_batch,
                                    seed=args.seed, num_replicas=world,
                                    rank=0 if world is not None else None)
    if old is not None:
        sampler.load_state_dict(old.state_dict())
    return sampler


def load_checkpoint(ckpt: CheckpointManager, state: dict) -> int:
    """Load the newest checkpoint into ``state``; its step, or -1 when there is none."""
    loaded = ckpt.load_latest(state)
    return loaded.step if loaded else -1


def hold_until_asked(max_s: float = 180.0) -> None:
    """(tests) Wait at a step boundary until the agent asks this node to stop, park or
    re-form (polling; no collective: only a world smaller than the job's holds)."""
    from elasticd.worker.context import park_requested, reform_ordered

    deadline = time.monotonic() + max_s
    while not (worker.stop_requested_locally() or park_requested() or reform_ordered()):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def wait_while_held(path: str | None, step: int, max_s: float = 180.0) -> None:
    """(tests) Wait before ``step`` while ``path`` names a step <= ``step`` (polling; every
    rank reads the file before the same step, so none enters a collective the others hold
    back)."""
    deadline = time.monotonic() + max_s
    while path and time.monotonic() < deadline:
        try:
            with open(path) as f:
                held = int(f.read().strip() or -1)
        except FileNotFoundError:
            return
        except ValueError:  # caught mid-write: read again
            held = step
        if step < held:
            return
        time.sleep(0.02)


def end_step(args: argparse.Namespace) -> int:
    """The steps to train in total: ``--steps``, or the count the test wrote to
    ``--end-file`` (written whole by a rename; every rank reads it at each step, so every
    rank ends at the same step)."""
    if args.end_file:
        try:
            with open(args.end_file) as f:
                return min(args.steps, int(f.read()))
        except (FileNotFoundError, ValueError):
            pass
    return args.steps


def train_epochs(args, ctx, step, x, y, ddp, optim, sampler, plan, live, trace, log, state, ckpt) -> int:
    """Train until ``args.steps``; returns the next step. Raises ``worker.Reformed``."""
    progress = state["extra"]
    while step < args.steps:
        epoch = sampler.epoch
        # The whole global batch of each step, for the trace: a step that one rank
        # completed before a peer died is in the model with every rank's share, even the
        # shares of ranks that never wrote their row.
        whole = make_sampler(args, sampler, world=1) if trace is not None else None
        wholes = whole.iter_steps() if whole is not None else None
        for share in sampler.iter_steps():
            args.steps = end_step(args)  # main's loop and this one read the same count
            wait_while_held(getattr(args, "pause_file", None), step)
            batch = next(wholes) if wholes is not None else None
            t0 = time.perf_counter()
            with live.guard():  # a failed collective (a peer died) re-forms the group
                sizes = plan.micro_batch_sizes(ctx.rank)
                total, start = 0.0, 0
                for size, sync_ctx in zip(sizes, worker.accumulation_contexts(ddp, plan), strict=True):
                    idx = torch.tensor(share[start:start + size], dtype=torch.long)
                    start += size
                    with sync_ctx:
                        loss = nn.functional.mse_loss(ddp(x[idx].to(ctx.device)), y[idx].to(ctx.device))
                        (loss * plan.loss_scale(size)).backward()
                    total += loss.item() * size
                optim.step()
                optim.zero_grad(set_to_none=True)
                sampler.step()
                progress["step"] = step
                if trace is not None:
                    trace.write(json.dumps({"step": step, "epoch": epoch, "rank": ctx.rank,
                                            "round": ctx.round, "world": ctx.world_size,
                                            "pid": os.getpid(), "time": time.time(),
                                            "idx": list(share), "global": batch}) + "\n")
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
                if live.step_done(step):  # a drain without live re-formation
                    ckpt.save(step, state, blocking=True)  # commit before exiting 0
                    if ctx.rank == 0:
                        log(event="drained", step=step)
                    ckpt.close()
                    # Committed: leave without the 1-3 s interpreter teardown the restart
                    # would wait for (this script registers no atexit work).
                    worker.fast_exit(0)
                if done or (step + 1) % args.checkpoint_every == 0:
                    ckpt.save(step, state, blocking=done)
                if ctx.under_agent and ctx.world_size < args.hold_below_world and not done:
                    hold_until_asked()
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
    model = make_model(dtype, args.seed, args.hidden).to(ctx.device)
    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = make_sampler(args)
    url = args.checkpoint_url or "file://" + os.path.abspath("checkpoints")
    ckpt = CheckpointManager(url, job=ctx.job or "local", keep_last=args.keep,
                             fence=worker.agent_fence(), run_id=ctx.run_id, resume=ctx.resume)
    progress = {"step": 0}
    state = {"model": model, "optim": optim, "sampler": sampler, "extra": progress}
    # Live re-formation: on a membership change the state stays in memory and is sent to
    # ranks that are behind or new; the checkpoint is read only when no rank holds it.
    live = worker.LiveState(state, checkpoint=ckpt)
    resumed_from = live.resume(lambda: load_checkpoint(ckpt, state))
    step = resumed_from + 1
    log = emit
    trace = open(args.trace, "a") if args.trace else None  # noqa: SIM115
    first = True

    while step < args.steps:
        # (Re)built for the current group: after a re-formation the world size, the rank
        # and the process group changed.
        ctx = worker.current_context()
        sampler = state["sampler"] = make_sampler(args, sampler)
        ddp = DDP(model) if dist.is_initialized() else model
        plan = worker.plan_global_batch(args.global_batch, ctx.world_size, args.micro_batch,
                                        allow_uneven=True)
        if ctx.rank == 0 and first:
            log(event="started", resumed_from=resumed_from if resumed_from >= 0 else None,
                world_size=ctx.world_size, micro_batch=plan.micro_batch_size,
                accumulation=plan.accumulation_steps)
        first = False
        try:
            step = train_epochs(args, ctx, step, x, y, ddp, optim, sampler, plan, live, trace, log,
                                state, ckpt)
        except worker.Reformed:
            step = live.step + 1  # continue after the newest step any rank completed
            if ctx.rank == 0:
                log(event="reformed", step=live.step, world_size=worker.current_context().world_size,
                    round=worker.current_context().round)
    ctx = worker.current_context()
    ckpt.close()
    if args.final_params and ctx.rank == 0:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, args.final_params)
    if ctx.rank == 0:
        log(event="finished", step=step - 1)
    worker.shutdown()
    return 0


if __name__ == "__main__":
    # Not sys.exit: under plain torchrun the interpreter's teardown can abort (SIGABRT,
    # "terminate called without an active exception") while a gloo thread still releases
    # the last collective; fast_exit skips it. Under elasticd run the launcher does this.
    worker.fast_exit(main())
