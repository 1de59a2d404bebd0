"""The one state skeleton (elasticd.checkpoint.skeleton): paths, the two walks, and the
shard placeholders a sharded checkpoint's state file holds where its DTensors were."""

from __future__ import annotations

import collections
import types

import pytest
import torch

from elasticd.checkpoint import shards, skeleton
from elasticd.checkpoint.staging import StateStager, resolve
from elasticd.errors import ConfigError

Pair = collections.namedtuple("Pair", "left right")


def _tree() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2)).state_dict()
    return {"model": model, "optim": {"state": {0: {"m": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]},
            "extra": [(None, 7), "s"]}


@pytest.mark.timeout(10)
def test_paths_are_the_strings_the_shard_indexes_name():
    """A leaf's path is ``state`` plus its keys as subscripts, as the stager always named them."""
    paths = [p for p, _ in skeleton.leaves_with_paths(_tree(), plain=True)]
    assert paths == ["state['model']['0.weight']", "state['model']['0.bias']",
                     "state['optim']['state'][0]['m']", "state['optim']['param_groups'][0]['lr']",
                     "state['extra'][0][0]", "state['extra'][0][1]", "state['extra'][1]"]


@pytest.mark.timeout(10)
def test_the_plain_walk_stops_where_safe_loading_would_and_reads_other_mappings_as_dicts():
    """Plain: a named tuple is one leaf (weights_only cannot read it back), a mapping proxy
    is walked as a dict; the pytree walk opens the named tuple."""
    tree = {"p": Pair(1, 2), "m": types.MappingProxyType({"a": torch.zeros(1)})}
    plain = skeleton.leaves_with_paths(tree, plain=True)
    assert [p for p, _ in plain] == ["state['p']", "state['m']['a']"]
    assert plain[0][1] == Pair(1, 2)
    assert [p for p, _ in skeleton.leaves_with_paths({"p": Pair(1, 2)})] == [
        "state['p'].left", "state['p'].right"]
    rebuilt = skeleton.map_leaves(tree, lambda _p, leaf: leaf, plain=True)
    assert type(rebuilt["m"]) is dict and rebuilt["p"] == Pair(1, 2)


@pytest.mark.timeout(10)
def test_rebuilt_containers_keep_their_type_and_state_dict_metadata():
    """map_leaves rebuilds ordered dicts, tuples and lists as they were, and carries
    ``_metadata`` (per-module versions) to the twin, at the top and nested."""
    tree = _tree()
    tree["nested"] = {"inner": torch.nn.Linear(1, 1).state_dict()}
    out = skeleton.map_leaves(tree, lambda _p, leaf: leaf * 2 if isinstance(leaf, torch.Tensor) else leaf,
                              plain=True)
    assert type(out["model"]) is collections.OrderedDict and type(out["extra"][0]) is tuple
    assert out["model"]._metadata == tree["model"]._metadata
    assert out["nested"]["inner"]._metadata == tree["nested"]["inner"]._metadata
    assert torch.equal(out["optim"]["state"][0]["m"], torch.full((2,), 2.0))


@pytest.mark.timeout(10)
def test_a_bad_key_is_refused_with_the_path_of_its_dict():
    """The stager's walk refuses a key safe loading could not read back, naming its dict,
    even when the key holds an empty container."""
    with pytest.raises(ConfigError, match=r"state\['x'\]: key \(1, 2\) is a tuple"):
        StateStager().stage(resolve({"x": {(1, 2): []}}), copy=False)


@pytest.mark.timeout(10)
def test_saved_dtensors_go_back_to_their_paths_and_the_rest_is_named_unfilled():
    """A sharded state file holds None at each DTensor's place (no tag): the reader puts
    the filled DTensor back by the index's path, marks the one the template had no place
    for, and reads the one-key placeholders of state files written before."""
    filled_w = torch.ones(2)  # stands in for a DTensor read into the template's sharding
    state = {"model": collections.OrderedDict(w=None, b=torch.zeros(1)),
             "optim": {"state": {0: {"exp_avg": None}}},
             "old": {"v": {"__elasticd_shard__": "state['old']['v']"}}}
    state["model"]._metadata = {"": {"version": 1}}
    saved = {"state['model']['w']", "state['optim']['state'][0]['exp_avg']", "state['old']['v']"}
    out = shards.place_shards(state, saved, {"state['model']['w']": filled_w,
                                             "state['old']['v']": filled_w})
    assert out["model"]["w"] is filled_w and out["old"]["v"] is filled_w
    assert out["model"]._metadata == {"": {"version": 1}}
    assert out["optim"]["state"][0]["exp_avg"] == shards.UnfilledShard("state['optim']['state'][0]['exp_avg']")
    assert shards.unfilled(out) == ["state['optim']['state'][0]['exp_avg']"]
    assert shards.unfilled(state) == []
