"""Runs examples/ddp_tutorial_elastic.py (or $TUTORIAL, e.g. ddp_tutorial_live.py) with a
probe: targets carry the sample index, and every trained batch is appended to $TRACE as
{"epoch", "idx", "pid", "rank", "world"}; $STEP_S slows each step ($STEP_S_ALONE at world size 1); $EPOCHS, $BATCH and
$DATASET size the run (3, 8, 96).

The test, not a step count, decides when a fault lands and when the job goes on:
while $PAUSE_FILE exists and holds N, a process that has trained N batches waits after
each batch (until the file goes, or its agent asks for a stop); $HOLD_BELOW_WORLD: at a
smaller world size, a rank waits after each batch until its agent asks it to stop, park or
re-form (a joiner's arrival), so a join never races the end of the job. Both wait at most
180 s, polling, with no collective."""

import importlib.util
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from elasticd.worker.context import park_requested, reform_ordered, stop_requested_locally

spec = importlib.util.spec_from_file_location(
    "ddp_tutorial_elastic", os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                         os.environ.get("TUTORIAL", "ddp_tutorial_elastic.py")))
tutorial = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tutorial)

base_getitem = tutorial.MyTrainDataset.__getitem__
base_run_batch = tutorial.Trainer._run_batch
trace = open(os.environ["TRACE"], "a")  # noqa: SIM115


def getitem(self, index):
    x, _ = base_getitem(self, index)
    return x, torch.tensor([float(index)])


trained = 0  # batches this process trained (any round)


def _paused() -> bool:
    pause = os.environ.get("PAUSE_FILE")
    if not pause or stop_requested_locally():
        return False
    try:
        with open(pause) as f:
            return trained >= int(f.read().strip() or 0)
    except FileNotFoundError:
        return False
    except ValueError:  # caught mid-write: read again
        return True


def _wait_while(cond) -> None:
    deadline = time.monotonic() + 180
    while cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def run_batch(self, source, targets):
    global trained
    base_run_batch(self, source, targets)
    trace.write(json.dumps({"epoch": self.train_data.sampler.epoch,
                            "idx": [int(t) for t in targets[:, 0]],
                            "drain_seen": stop_requested_locally(), "pid": os.getpid(),
                            "rank": dist.get_rank(), "world": dist.get_world_size()}) + "\n")
    trace.flush()
    alone = dist.get_world_size() == 1 and os.environ.get("STEP_S_ALONE")
    time.sleep(float(alone or os.environ.get("STEP_S", "0")))
    trained += 1
    _wait_while(_paused)
    if dist.get_world_size() < int(os.environ.get("HOLD_BELOW_WORLD", "0")):
        _wait_while(lambda: not (stop_requested_locally() or park_requested() or reform_ordered()))


tutorial.MyTrainDataset.__getitem__ = getitem
tutorial.Trainer._run_batch = run_batch
os.chdir(os.environ["WORKDIR"])
tutorial.main(save_every=1, total_epochs=int(os.environ.get("EPOCHS", "3")),
              batch_size=int(os.environ.get("BATCH", "8")),
              dataset_size=int(os.environ.get("DATASET", "96")))
sys.exit(0)
