"""ElasticStream: a sharded stream resumes after any resize with every sample trained once."""

from __future__ import annotations

import itertools
import json
import struct
import uuid
from collections import Counter

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.data import ElasticStream, FixedRecordFormat, JsonLinesFormat, Shard
from elasticd.data.stream import locate
from elasticd.errors import ConfigError


def _write_shards(sizes: list[int], fixed: bool = False) -> list[Shard]:
    """Write shards to memory://; sample k (global) is {"id": k} or 8 bytes of k."""
    root = f"memory://stream-{uuid.uuid4().hex}"
    shards, k = [], 0
    for i, size in enumerate(sizes):
        url = f"{root}/shard-{i:04d}.{'bin' if fixed else 'jsonl'}"
        with fsspec.open(url, "wb") as f:
            for _ in range(size):
                f.write(struct.pack("<q", k) if fixed else (json.dumps({"id": k}) + "\n").encode())
                k += 1
        shards.append(Shard(url, size))
    return shards


def _ids(samples):
    return [s["id"] if isinstance(s, dict) else struct.unpack("<q", s)[0] for s in samples]


def test_locate_skips_empty_shards():
    """Global positions map to (shard, offset), empty shards holding none."""
    cum = list(itertools.accumulate([3, 0, 2, 0, 0, 4]))
    assert [locate(cum, p) for p in range(9)] == [
        (0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (5, 0), (5, 1), (5, 2), (5, 3)]


def _run(shards, g, segments, fmt=None):
    """Train resize segments [(world, steps)] then finish; per global step, the sorted ids."""
    state = None
    per_step: list[list[int]] = []
    for i, (w, steps) in enumerate(segments):
        last = i == len(segments) - 1
        ranks = [ElasticStream(shards, global_batch_size=g, num_replicas=w, rank=r, format=fmt)
                 for r in range(w)]
        for s in ranks:
            if state is not None:
                s.load_state_dict(state)
        iters = [s.iter_steps() for s in ranks]
        done = 0
        while (last or done < steps) and ranks[0].steps_remaining:
            per_step.append(sorted(i for it in iters for i in _ids(next(it))))
            for s in ranks:
                s.step()
            done += 1
        state = ranks[0].state_dict()
    return per_step


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), min_size=1, max_size=6).filter(lambda s: sum(s) > 0),
       g=st.integers(1, 9),
       segments=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 4)), min_size=1, max_size=4))
def test_any_resize_sequence_trains_every_sample_exactly_once(sizes, g, segments):
    """Random shard sizes (empty ones too), global batch and resize sequence: the epoch's
    global batches are those of one uninterrupted rank, so every sample is trained once."""
    segments = [(min(w, g), k) for w, k in segments]  # a global batch needs >= W samples
    shards = _write_shards(sizes)
    got = _run(shards, g, segments)
    assert got == _run(shards, g, [(1, 0)])
    assert Counter(i for step in got for i in step) == Counter(range(sum(sizes)))


def test_fixed_records_seek_to_the_same_samples():
    """Fixed-size records (seeked) and JSON lines (scanned) give the same steps after a resize."""
    sizes = [7, 0, 5, 9]
    fixed = _run(_write_shards(sizes, fixed=True), 4, [(2, 2), (3, 1), (1, 0)],
                 fmt=FixedRecordFormat(8))
    lines = _run(_write_shards(sizes), 4, [(2, 2), (3, 1), (1, 0)], fmt=JsonLinesFormat())
    assert fixed == lines and sum(len(s) for s in fixed) == 21


def test_state_names_the_last_trained_sample_and_refuses_other_shards():
    """state_dict holds the (shard, offset) of the last trained sample; other shard sizes
    are refused on load."""
    shards = _write_shards([5, 5])
    s = ElasticStream(shards, global_batch_size=3, num_replicas=1, rank=0)
    s.step(2)
    st_ = s.state_dict()
    assert (st_["samples_trained"], st_["last_trained_shard"], st_["last_trained_offset"]) == (6, 1, 0)
    with pytest.raises(ConfigError, match="shard"):
        ElasticStream(_write_shards([4, 6]), global_batch_size=3, num_replicas=1,
                      rank=0).load_state_dict(st_)
    with pytest.raises(ConfigError, match="empty"):
        ElasticStream([Shard("memory://x", 0)], global_batch_size=1, num_replicas=1, rank=0)
