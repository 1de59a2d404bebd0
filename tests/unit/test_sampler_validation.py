"""ElasticSampler inputs are validated where they enter (construction, set_epoch, load), so a
bad value fails at once with a ConfigError naming the field, never later or in a checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.data import ElasticSampler
from elasticd.data.batch_sampler import ElasticBatchSampler
from elasticd.data.batching import plan_global_batch
from elasticd.errors import ConfigError


def _sampler(**kw) -> ElasticSampler:
    return ElasticSampler(100, **{"global_batch_size": 8, "num_replicas": 2, "rank": 0, **kw})


def test_negative_epoch_is_refused_at_set_epoch():
    """set_epoch(-1) fails at once (its saved state could never be loaded)."""
    sampler = _sampler()
    with pytest.raises(ConfigError, match=r"epoch must be >= 0, got -1.*range\(sampler.epoch"):
        sampler.set_epoch(-1)
    assert sampler.epoch == 0


@pytest.mark.parametrize("value", [8.0, 8.5, "8", True, None])
def test_non_integer_global_batch_is_refused_at_construction(value):
    """A float, str, bool or None global batch size is a ConfigError naming the field and value."""
    with pytest.raises(ConfigError, match=r"global_batch_size must be a whole number, got"):
        _sampler(global_batch_size=value)


def test_numpy_integers_give_a_json_state():
    """NumPy ints are accepted and stored as Python ints: the state is plain JSON."""
    sampler = ElasticSampler(np.int64(100), global_batch_size=np.int64(8),
                             num_replicas=np.int32(2), rank=np.int64(1), seed=np.uint8(3),
                             shuffle=np.bool_(True))
    sampler.set_epoch(np.int64(1))
    sampler.step()
    state = sampler.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert all(type(v) in (int, bool, str) for v in state.values())


@pytest.mark.parametrize("state", [None, [], "state", 3])
def test_load_state_dict_of_a_non_mapping_is_a_config_error(state):
    """load_state_dict(None) names the problem and the fix instead of AttributeError."""
    with pytest.raises(ConfigError, match=r"not a dict.*ElasticSampler.state_dict"):
        _sampler().load_state_dict(state)


@pytest.mark.parametrize("key,value,match", [
    ("epoch", 2.7, "epoch must be a whole number, got 2.7"),
    ("samples_trained", 16.5, "samples_trained must be a whole number, got 16.5"),
    ("samples_trained", 16.0, "samples_trained must be a whole number, got 16.0"),
    ("epoch", -1, "epoch must be >= 0, got -1"),
    ("epoch", "1", "epoch must be a whole number"),
    ("global_batch_size", 8.0, "global_batch_size must be a whole number"),
    ("drop_last", "yes", "drop_last must be True or False"),
    ("dataset_len", 100.0, "dataset_len must be a whole number"),
])
def test_saved_fields_of_the_wrong_type_are_refused_not_truncated(key, value, match):
    """A fractional or mistyped counter in a saved state is refused, naming field and value."""
    sampler = _sampler()
    state = {**sampler.state_dict(), key: value}
    with pytest.raises(ConfigError, match=match):
        sampler.load_state_dict(state)
    assert (sampler.epoch, sampler.samples_trained) == (0, 0)


def test_batch_sampler_refuses_what_is_not_a_sampler_or_plan():
    """ElasticBatchSampler with a list or a dict names the type it needs."""
    sampler = _sampler()
    plan = plan_global_batch(8, 2, 4)
    with pytest.raises(ConfigError, match="needs an ElasticSampler"):
        ElasticBatchSampler(list(range(10)), plan)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs a BatchPlan"):
        ElasticBatchSampler(sampler, {"global_batch_size": 8})  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 500), g=st.integers(1, 64), w=st.integers(1, 8),
       epoch=st.integers(0, 5), steps=st.integers(0, 10))
def test_every_constructible_sampler_state_round_trips(n, g, w, epoch, steps):
    """Property: whatever a valid sampler can reach, its JSON state loads back exactly."""
    try:
        sampler = ElasticSampler(n, global_batch_size=g, num_replicas=w, rank=0, drop_last=g <= n)
    except ConfigError:
        return  # an unusable config, refused up front
    sampler.set_epoch(epoch)
    if min(steps, sampler.steps_remaining):
        sampler.step(min(steps, sampler.steps_remaining))
    state = json.loads(json.dumps(sampler.state_dict()))
    other = ElasticSampler(n, global_batch_size=g, num_replicas=w, rank=0, drop_last=g <= n)
    other.load_state_dict(state)
    assert (other.epoch, other.samples_trained) == (sampler.epoch, sampler.samples_trained)


@settings(max_examples=100, deadline=None)
@given(value=st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=3) | st.booleans())
def test_no_non_integer_epoch_is_ever_accepted(value):
    """Property: set_epoch accepts nothing but whole numbers."""
    with pytest.raises(ConfigError):
        _sampler().set_epoch(value)
