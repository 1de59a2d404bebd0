"""Runs examples/ddp_tutorial_elastic.py (or $TUTORIAL, e.g. ddp_tutorial_live.py) with a
probe: targets carry the sample index, and every trained batch is appended to $TRACE as
{"epoch", "idx", "pid", "rank", "world"}; $STEP_S slows each step ($STEP_S_ALONE at world size 1); $EPOCHS, $BATCH and
$DATASET size the run (3, 8, 96)."""

import importlib.util
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from elasticd.worker.context import stop_requested_locally

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


def run_batch(self, source, targets):
    base_run_batch(self, source, targets)
    trace.write(json.dumps({"epoch": self.train_data.sampler.epoch,
                            "idx": [int(t) for t in targets[:, 0]],
                            "drain_seen": stop_requested_locally(), "pid": os.getpid(),
                            "rank": dist.get_rank(), "world": dist.get_world_size()}) + "\n")
    trace.flush()
    alone = dist.get_world_size() == 1 and os.environ.get("STEP_S_ALONE")
    time.sleep(float(alone or os.environ.get("STEP_S", "0")))


tutorial.MyTrainDataset.__getitem__ = getitem
tutorial.Trainer._run_batch = run_batch
os.chdir(os.environ["WORKDIR"])
tutorial.main(save_every=1, total_epochs=int(os.environ.get("EPOCHS", "3")),
              batch_size=int(os.environ.get("BATCH", "8")),
              dataset_size=int(os.environ.get("DATASET", "96")))
sys.exit(0)
