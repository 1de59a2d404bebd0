"""The Lightning integration's decisions: checkpoint names, refused Trainer settings, the
cluster environment's node-count rule and the callback's input checks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning", reason="the Lightning integration's tests need elasticd[lightning]")

from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402

from elasticd.errors import ConfigError  # noqa: E402
from elasticd.integrations.lightning import (  # noqa: E402
    ElasticCallback,
    ElasticEnvironment,
    check_accumulation,
    check_accumulation_supported,
    check_loader,
    checkpoint_state,
)

pytestmark = pytest.mark.timeout(60)
ELASTIC_ENV = {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
               "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_checkpoint_state_names_one_optimizer_and_scheduler_as_elastic_loop_expects():
    """One optimizer and one scheduler are "optimizer" and "scheduler", beside "model"."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    assert checkpoint_state(model, [opt], [sched]) == {"model": model, "optimizer": opt, "scheduler": sched}
    assert checkpoint_state(model, [opt], []) == {"model": model, "optimizer": opt}


def test_checkpoint_state_numbers_several_optimizers():
    """Several optimizers (a GAN's two) are numbered from 0, so each keeps its state."""
    model = torch.nn.Linear(2, 1)
    a, b = (torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2))
    assert checkpoint_state(model, [a, b], []) == {"model": model, "optimizer_0": a, "optimizer_1": b}


def test_a_loader_without_elasticds_batch_sampler_is_refused_naming_the_trainer_flag():
    """A loader whose batch sampler Lightning replaced is refused, naming use_distributed_sampler."""
    ours = object()
    check_loader(ours, ours)
    with pytest.raises(ConfigError, match="use_distributed_sampler=False"):
        check_loader(object(), ours)


def test_the_trainers_own_accumulation_is_refused():
    """accumulate_grad_batches set on the Trainer would change the global batch: refused."""
    check_accumulation(1)
    with pytest.raises(ConfigError, match="accumulate_grad_batches"):
        check_accumulation(4)


def test_accumulation_with_manual_optimization_is_refused():
    """A plan of several micro-batches per step needs automatic optimization."""
    check_accumulation_supported(2, True)
    check_accumulation_supported(1, False)
    with pytest.raises(ConfigError, match="max_micro_batch"):
        check_accumulation_supported(2, False)


def test_environment_accepts_any_node_count_but_devices_must_divide_the_world(monkeypatch):
    """Under an agent the node count is the rendezvous': devices x num_nodes need not be the
    world size, but devices (processes per node) must divide it."""
    for key, value in ELASTIC_ENV.items():
        monkeypatch.setenv(key, value)
    env = ElasticCallback(global_batch_size=8).environment()
    assert isinstance(env, ElasticEnvironment)
    env.validate_settings(num_devices=2, num_nodes=1)  # 4 ranks, nodes joined since start
    with pytest.raises(ValueError, match="nproc-per-node"):
        env.validate_settings(num_devices=3, num_nodes=1)


def test_environment_outside_torchelastic_is_lightnings_own(monkeypatch):
    """Run by hand (no torchrun variables) Lightning starts the processes: its default env."""
    for key in ELASTIC_ENV:
        monkeypatch.delenv(key, raising=False)
    assert isinstance(ElasticCallback(global_batch_size=8).environment(), LightningEnvironment)


def test_callback_refuses_bad_sizes_and_a_second_loader():
    """A global batch < 1 fails at construction; one callback serves one training loader."""
    with pytest.raises(ConfigError):
        ElasticCallback(global_batch_size=0)
    elastic = ElasticCallback(global_batch_size=4, max_micro_batch=2)
    data = list(range(16))
    batches = list(elastic.batch_sampler(data))
    assert len(batches) == 8 and all(len(b) == 2 for b in batches)  # world 1: 2 micro-batches per step
    assert sorted(i for b in batches for i in b) == data
    with pytest.raises(ConfigError, match="twice"):
        elastic.batch_sampler(data)
