"""Sharded checkpoint worker: FSDP2/HSDP save at one world size, resharded load at others.

Run as ``python sharded_ckpt.py <ranks> <workdir> <phases json>``: this process imports torch
once and forks the ``<ranks>`` rank processes (four imports of torch and of
torch._dynamo, which fully_shard imports, would be most of the test's time); it exits 1 if any rank failed, after all ended. Each phase is
``[world, mesh, action]`` with mesh ``hsdp`` (2 x world/2) or ``fsdp`` (1-D), action
``save`` (train two Adam steps, save steps 1 and 2) or ``load`` (a differently seeded model,
load the newest valid checkpoint). Rank r of each phase writes ``<phase>-r<r>.json`` with
what it loaded and the gathered (full) parameters and Adam moments, as lists. A rank
beyond a phase's world leaves. Between phases every rank waits for ``go-<phase>`` (the
test creates it, after corrupting a shard when it wants to).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def model_on(mesh, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full(model, optim) -> dict:
    out = {f"p.{n}": p.full_tensor().tolist() for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        st = optim.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                out[f"o.{i}.{k}"] = st[k].full_tensor().tolist()
        if "step" in st:
            out[f"o.{i}.step"] = float(st["step"])
    return out


def main() -> None:
    ranks, workdir, phases = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    # Imported before the fork, once: torch._dynamo is what fully_shard's first call imports
    # (seconds of CPU per rank otherwise).
    import torch._dynamo  # noqa: F401

    import elasticd.checkpoint  # noqa: F401

    pids = {}
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:  # a rank: its own process (gloo, its own FileStore client)
            code = 1
            try:
                run_rank(rank, workdir, phases)
                code = 0
            except BaseException:  # noqa: BLE001 - printed, then the exit code says it
                import traceback

                traceback.print_exc()
                sys.stderr.write(f"rank {rank} failed\n")
            finally:
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    while pids:  # the first failure ends the others (they would wait on it in gloo)
        pid, status = os.wait()
        rank = pids.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            for other in pids:
                os.kill(other, signal.SIGKILL)
            sys.exit(f"rank {rank} failed")


def run_rank(rank: int, workdir: str, phases: list) -> None:
    from elasticd.checkpoint import CheckpointManager
    from elasticd.logs import configure_logging

    configure_logging("json")
    url = f"file://{workdir}/ckpt"
    for n, (world, kind, action) in enumerate(phases):
        go = f"{workdir}/go-{n}"
        deadline = time.monotonic() + 150
        while not os.path.exists(go):  # the test's signal: its checks of storage are done
            if time.monotonic() > deadline:
                raise SystemExit(f"no {go} within 150 s")
            time.sleep(0.01)
        if rank >= world:
            return
        store = dist.FileStore(f"{workdir}/store-{n}", world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        shape = (2, world // 2) if kind == "hsdp" else (world,)
        names = ("replicate", "shard") if kind == "hsdp" else ("shard",)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = model_on(mesh, 0 if action == "save" else 99)
        optim = torch.optim.Adam(model.parameters(), lr=0.05)
        mgr = CheckpointManager(url, job="sharded", keep_last=5, fence=None)
        out: dict = {}
        if action == "save":
            gen = torch.Generator().manual_seed(7)
            x = torch.randn(world * 2, 5, generator=gen, dtype=torch.float64)
            for step in (1, 2):
                optim.zero_grad()
                model(x[rank * 2:(rank + 1) * 2]).pow(2).mean().backward()
                optim.step()
                mgr.save(step, {"model": model, "optim": optim, "extra": {"step": step}})
                mgr.wait()
                out[f"step{step}"] = full(model, optim)
        else:
            extra: dict = {}
            loaded = mgr.load_latest({"model": model, "optim": optim, "extra": extra})
            out["loaded_step"] = loaded.step if loaded else None
            out["extra"] = extra
            out["skipped"] = [s.reason for s in loaded.skipped] if loaded else []
            out["state"] = full(model, optim)
        mgr.close()
        with open(f"{workdir}/{n}-r{rank}.json", "w") as f:
            json.dump(out, f)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
