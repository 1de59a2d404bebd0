"""Save at world size 4, resume at 3, then at 2: real processes over gloo.

Four processes (this file run as a script) go through three phases, each with a fresh
gloo group over a FileStore: all four train two data-parallel steps and save step 2;
ranks 0-2 load it, check it, train a step and save step 3; ranks 0-1 load that. Each rank
writes what it saw to a JSON file; the test compares them across phases.

Gradients are averaged with all_reduce and applied by hand (SGD with a momentum dict
standing in for an optimizer's state): DistributedDataParallel and torch.optim import
torch._dynamo in every process, seconds of CPU each, and the single-process tests already
cover real optimizers and schedulers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

PHASES = ((4, "save"), (3, "resume_and_save"), (2, "resume"))


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _params_sum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _train(model, optim: dict, rank: int, steps: int) -> None:
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
                buf = optim["momentum"].setdefault(name, torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.sub_(0.1 * buf)
        optim["step"] += 1


def _child(rank: int, workdir: str) -> None:
    import torch.distributed as dist

    from elasticd.checkpoint import CheckpointManager
    from elasticd.logs import configure_logging

    configure_logging("json")
    url = f"file://{workdir}/ckpt"
    for world, kind in PHASES:
        if rank >= world:
            return
        store = dist.FileStore(f"{workdir}/store-{world}", world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            torch.manual_seed(0 if kind == "save" else 1234 + rank)  # resumers start different
            model = _model()
            optim = {"step": 0, "momentum": {n: torch.zeros_like(p) for n, p in model.named_parameters()}}
            out: dict = {}
            mgr = CheckpointManager(url, job="mp", keep_last=5)
            if kind != "save":
                sampler = {}
                loaded = mgr.load_latest({"model": model, "optim": optim, "sampler": sampler})
                out.update(loaded_step=loaded.step, loaded_world=loaded.world_size,
                           params_after_load=_params_sum(model), sampler=sampler,
                           optim_step=optim["step"],
                           momentum_after_load=float(sum(b.double().sum()
                                                         for b in optim["momentum"].values())),
                           draw_after_load=torch.rand(3).tolist())
            if kind != "resume":
                _train(model, optim, rank, 2 if kind == "save" else 1)
                step = 2 if kind == "save" else 3
                torch.manual_seed(100 * world + rank)  # a distinct RNG state per rank
                mgr.save(step, {"model": model, "optim": optim,
                                "sampler": {"samples_trained": step * 16, "saved_by": world}})
                out.update(draw_after_save=torch.rand(3).tolist(), params=_params_sum(model),
                           momentum_sum=float(sum(b.double().sum() for b in optim["momentum"].values())))
            mgr.close()
            with open(f"{workdir}/r{world}-{rank}.json", "w") as f:
                json.dump(out, f)
            dist.barrier()
        finally:
            dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_save_at_world_size_4_and_resume_at_3_then_2(tmp_path):
    """Every resumed rank gets the saved weights, optimizer and sampler, and rank r the RNG of
    saved rank r % saved world size; all ranks load the same checkpoint."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
             for rank in range(4)]
    deadline = time.monotonic() + 100
    try:
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, f"rank {rank} failed:\n{err.decode()[-4000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def res(world: int, rank: int) -> dict:
        return json.loads((tmp_path / f"r{world}-{rank}.json").read_text())

    saved4 = res(4, 0)
    assert all(res(4, r)["params"] == saved4["params"] for r in range(4))  # averaged grads kept them equal
    for r in range(3):
        got = res(3, r)
        assert (got["loaded_step"], got["loaded_world"]) == (2, 4)
        assert got["params_after_load"] == saved4["params"]
        assert got["optim_step"] == 2 and got["momentum_after_load"] == saved4["momentum_sum"]
        assert got["sampler"] == {"samples_trained": 32, "saved_by": 4}
        assert got["draw_after_load"] == res(4, r)["draw_after_save"]
    for r in range(2):
        got = res(2, r)
        assert (got["loaded_step"], got["loaded_world"]) == (3, 3)
        assert got["params_after_load"] == res(3, 0)["params"]
        assert got["optim_step"] == 3 and got["momentum_after_load"] == res(3, 0)["momentum_sum"]
        assert got["draw_after_load"] == res(3, r)["draw_after_save"]


if __name__ == "__main__":
    _child(int(sys.argv[1]), sys.argv[2])
