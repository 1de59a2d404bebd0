"""Runs examples/ddp_tutorial_elastic.py with a probe: targets carry the sample index, and
every trained batch is appended to $TRACE as {"epoch", "idx"}; $STEP_S slows each step."""

import importlib.util
import json
import os
import sys
import time

import torch

from elasticd.worker.context import stop_requested_locally

spec = importlib.util.spec_from_file_location(
    "ddp_tutorial_elastic", os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                         "ddp_tutorial_elastic.py"))
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
                            "drain_seen": stop_requested_locally()}) + "\n")
    trace.flush()
    time.sleep(float(os.environ.get("STEP_S", "0")))


tutorial.MyTrainDataset.__getitem__ = getitem
tutorial.Trainer._run_batch = run_batch
os.chdir(os.environ["WORKDIR"])
tutorial.main(save_every=1, total_epochs=3, batch_size=8, dataset_size=96)
sys.exit(0)
