"""Staging, safe deserialisation, template checks, RNG capture and the memory fence."""

from __future__ import annotations

import io
import os
import pickle
import random
from collections import OrderedDict

import pytest
import torch

from elasticd.checkpoint import MemoryCommitFence
from elasticd.checkpoint import rng as rng_state
from elasticd.checkpoint.api import CheckpointCorruptError, CheckpointMismatchError
from elasticd.checkpoint.restore import apply, check_fits, deserialize
from elasticd.checkpoint.staging import StateStager, resolve
from elasticd.errors import ConfigError


def _net(hidden: int = 4) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Linear(hidden, 2))


def _bytes(obj) -> bytearray:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return bytearray(buf.getvalue())


def test_staged_copy_is_frozen_while_the_live_tensor_changes():
    """After staging, in-place updates of the live parameters do not reach the snapshot."""
    model = _net()
    staged, event = StateStager().stage(resolve({"model": model}))
    before = staged["model"]["0.weight"].clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert event is None
    assert torch.equal(staged["model"]["0.weight"], before)


def test_staging_buffers_are_reused_between_saves():
    """The second save copies into the first save's buffers (no new allocation)."""
    model, stager = _net(), StateStager()
    first, _ = stager.stage(resolve({"model": model}))
    second, _ = stager.stage(resolve({"model": model}))
    assert first["model"]["0.weight"].data_ptr() == second["model"]["0.weight"].data_ptr()


def test_large_states_are_copied_on_threads_exactly():
    """Past the parallel threshold the copy runs on a thread pool and is still exact."""
    state = {"m": {f"w{i}": torch.randn(3 << 20) for i in range(4)}}  # 48 MiB
    stager = StateStager()
    staged, _ = stager.stage(state)
    assert stager._pool is not None
    assert all(torch.equal(staged["m"][k], v) for k, v in state["m"].items())
    stager.release()
    assert stager._pool is None


def test_tied_weights_are_staged_once():
    """Two keys viewing one storage share one staged tensor, like torch.save would."""
    w = torch.randn(4, 4)
    staged, _ = StateStager().stage({"m": {"a": w, "b": w}})
    assert staged["m"]["a"] is staged["m"]["b"]


def test_state_dict_metadata_survives_staging():
    """OrderedDict type and the per-module _metadata that load_state_dict reads are kept."""
    staged, _ = StateStager().stage(resolve({"model": _net()}))
    assert isinstance(staged["model"], OrderedDict)
    assert hasattr(staged["model"], "_metadata")


@pytest.mark.parametrize("value, path", [
    (lambda: 1, "state['extra']['cb']"),
    ({1, 2}, "state['extra']['cb']"),
    (io.BytesIO(), "state['extra']['cb']"),
])
def test_unloadable_values_are_refused_at_save_time_naming_the_path(value, path):
    """Anything weights_only loading could not read back fails the save, naming where it is."""
    with pytest.raises(ConfigError, match=path.replace("[", r"\[").replace("]", r"\]")):
        StateStager().stage(resolve({"extra": {"cb": value}}), copy=False)


def test_reserved_and_non_string_top_level_keys_are_refused():
    """The manager's own key and non-string keys cannot be used by callers."""
    with pytest.raises(ConfigError, match="__elasticd"):
        resolve({"__elasticd__": 1})
    with pytest.raises(ConfigError):
        resolve({1: 2})


def test_resolve_unwraps_objects_with_state_dict():
    """Modules, optimizers and samplers are saved through their state_dict()."""
    model = _net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    out = resolve({"model": model, "optim": optim, "n": 3})
    assert set(out["model"]) == set(model.state_dict())
    assert "param_groups" in out["optim"]
    assert out["n"] == 3


def test_deserialize_refuses_arbitrary_pickles():
    """A data file holding a pickled callable is corrupt: weights_only never runs it."""
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    # A genuine torch zip whose pickle calls os.system, and a bare pickle doing the same.
    for payload in (_bytes({"x": Evil()}), bytearray(pickle.dumps(Evil(), protocol=2))):
        with pytest.raises(CheckpointCorruptError, match="weights_only"):
            deserialize(payload, "state.pt")
    with pytest.raises(CheckpointCorruptError):
        deserialize(bytearray(b"not a torch file"), "state.pt")


def test_deserialize_reads_tensors_and_containers():
    """Plain state (tensors, tuples, int-keyed dicts) loads back equal."""
    state = {"t": torch.arange(5), "betas": (0.9, 0.99), "state": {0: {"step": torch.tensor(3.0)}}}
    got = deserialize(_bytes(state), "state.pt")
    assert torch.equal(got["t"], state["t"]) and got["betas"] == (0.9, 0.99)
    assert got["state"][0]["step"].item() == 3.0


def test_incompatible_model_names_the_mismatch():
    """A checkpoint of another architecture fails with missing keys and shapes named."""
    saved = {"model": _net(hidden=8).state_dict()}
    with pytest.raises(CheckpointMismatchError, match=r"shape mismatches: 0.weight \(checkpoint \[8, 3\] vs model \[4, 3\]\)"):
        check_fits({"model": _net(hidden=4)}, saved, "checkpoint step 5")
    with pytest.raises(CheckpointMismatchError, match="missing keys: 1.weight, 1.bias"):
        check_fits({"model": _net()}, {"model": {k: v for k, v in _net().state_dict().items()
                                                  if k.startswith("0.")}}, "ckpt")
    with pytest.raises(CheckpointMismatchError, match="has no 'optim'"):
        check_fits({"optim": {}}, {"model": {}}, "ckpt")


def test_optimizer_mismatch_is_wrapped_with_the_key():
    """An optimizer that does not fit raises a one-line error naming 'optim', not torch's trace."""
    model = _net()
    saved = torch.optim.Adam(model.parameters()).state_dict()
    other = torch.optim.Adam(list(model.parameters())[:1])
    with pytest.raises(CheckpointMismatchError, match="'optim' does not fit the Adam"):
        apply({"optim": other}, {"optim": saved}, "ckpt")


def test_apply_fills_templates_in_place():
    """Modules get load_state_dict, tensors and nested dicts are filled in place."""
    src, dst = _net(), _net()
    t = torch.zeros(3)
    extra = {"t": t, "keep": 1}
    apply({"model": dst, "extra": extra},
          {"model": src.state_dict(), "extra": {"t": torch.ones(3), "new": "x"}}, "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True))
    assert extra["t"] is t and torch.equal(t, torch.ones(3)) and extra["new"] == "x" and extra["keep"] == 1


def test_rng_restore_maps_ranks_modulo_saved_world_size():
    """Rank r restores saved rank r % n, so draws continue exactly where they stopped."""
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        random.seed(seed)
        states.append(deserialize(_bytes(rng_state.capture()), "rng"))
    torch.manual_seed(2)
    random.seed(2)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    assert rng_state.restore(states, rank=3) == 1
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert rng_state.restore([], rank=0) == -1


def test_memory_fence_refuses_stale_rounds_and_older_steps():
    """Only the current round commits, and only forwards; a new round may move back."""
    live = MemoryCommitFence(round_=1)
    zombie = live.for_round(0)
    assert live.commit(100, "u100", 4)
    assert not zombie.commit(500, "z500", 4)
    assert not live.commit(100, "again", 4)
    assert live.latest().manifest_url == "u100"
    live.current_round = 2
    assert not live.commit(200, "u200", 4)  # round 1 is stale now
    resumed = live.for_round(2)
    assert resumed.commit(50, "u50", 2)  # new round resumed from an older checkpoint
    assert resumed.latest().step == 50 and resumed.latest().round == 2


def test_data_parallel_wrappers_are_unwrapped_on_save_and_load():
    """A model saved through a (Distributed)DataParallel wrapper loads into the bare module."""
    model = _net()
    saved = resolve({"model": torch.nn.DataParallel(model)})["model"]
    assert set(saved) == set(model.state_dict())  # no "module." prefix
    target = torch.nn.DataParallel(_net())
    apply({"model": target}, {"model": saved}, "ckpt")
    assert torch.equal(target.module[0].weight, model[0].weight)
