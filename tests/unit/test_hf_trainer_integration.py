"""elasticd.integrations.transformers without a process group: the refusals and the loader's sizes."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra: pip install 'elasticd[hf]'")

from elasticd.data.batch_sampler import ElasticBatchSampler  # noqa: E402
from elasticd.data.batching import plan_global_batch  # noqa: E402
from elasticd.data.sampler import ElasticSampler  # noqa: E402
from elasticd.errors import ConfigError  # noqa: E402
from elasticd.integrations.transformers import ElasticTrainer, EpochLoader  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("size", [None, 0])
def test_trainer_refuses_a_missing_global_batch(size):
    """ElasticTrainer without a global batch size raises ConfigError naming the argument."""
    with pytest.raises(ConfigError, match="global_batch_size"):
        ElasticTrainer(global_batch_size=size)


@pytest.mark.parametrize(("world", "rank", "micro", "want_len"), [
    (1, 0, 4, 12),  # 6 steps x 2 micro-steps
    (2, 1, 4, 6),   # 6 steps x 1
    (3, 2, 2, 12),  # shares 3,3,2: 2 micro-steps each
])
def test_loader_length_is_a_whole_epoch_at_every_world_size(world, rank, micro, want_len):
    """The loader's length is a whole epoch of micro-batches (the Trainer sizes its schedule
    from it), also after the sampler moved mid-epoch; it yields nothing once finished."""
    sampler = ElasticSampler(48, global_batch_size=8, num_replicas=world, rank=rank, seed=0)
    plan = plan_global_batch(8, world, micro, allow_uneven=True)
    done = [False]
    loader = EpochLoader(list(range(48)), ElasticBatchSampler(sampler, plan), None, lambda: done[0])
    assert len(loader) == want_len
    sampler.step()
    sampler.step()
    assert len(loader) == want_len
    assert sum(1 for _ in loader) == want_len - 2 * plan.accumulation_steps
    done[0] = True
    assert list(loader) == []
