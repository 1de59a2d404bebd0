"""`elasticd checkpoints`: table, JSON, --verify and exit codes, on memory://."""

from __future__ import annotations

import argparse
import io
import json
import uuid

import fsspec
import pytest
import torch

from elasticd.checkpoint import CheckpointManager
from elasticd.checkpoint.manifest import STATE_FILE
from elasticd.cli.checkpoints import add_parser, parse_storage_options
from elasticd.errors import EX_CONFIG, ConfigError


@pytest.fixture
def url():
    """A memory:// root with two jobs: 'a' (steps 1, 2) and 'b' (step 5)."""
    name = f"cli-{uuid.uuid4().hex[:8]}"
    root = f"memory://{name}"
    for job, steps in (("a", (1, 2)), ("b", (5,))):
        mgr = CheckpointManager(root, job=job, keep_last=5)
        for step in steps:
            mgr.save(step, {"w": torch.full((16,), float(step))}, blocking=True)
    yield root
    fsspec.filesystem("memory").rm(f"/{name}", recursive=True)


def _run(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="elasticd")
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["checkpoints", *argv])
    out, err = io.StringIO(), io.StringIO()
    code = args.func(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_lists_every_job_with_step_size_world_and_validity(url):
    """Without --job, every job's checkpoints are listed newest first, exit 0 when all valid."""
    code, out, _ = _run(url)
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split()[:5] == ["JOB", "STEP", "SAVED", "(UTC)", "SIZE"]
    assert [(ln.split()[0], ln.split()[1]) for ln in lines[1:]] == [("a", "2"), ("a", "1"), ("b", "5")]
    assert all(ln.rstrip().endswith("yes") for ln in lines[1:])


def test_verify_catches_flipped_bytes_and_exits_1(url):
    """--verify re-reads data: a flipped byte makes that checkpoint invalid with its reason."""
    mgr = CheckpointManager(url, job="a")
    save = mgr.store.list_saves()[0]
    path = f"{mgr.store.save_path(save.step, save.save_id)}/{STATE_FILE}"
    data = bytearray(mgr.store.fs.cat_file(path))
    data[-100] ^= 1
    mgr.store.fs.pipe_file(path, bytes(data))
    assert _run(url, "--job", "a")[0] == 0  # sizes still match: only --verify can tell
    code, out, err = _run(url, "--job", "a", "--verify", "--json")
    doc = json.loads(out)
    assert code == 1 and "1 of 2 checkpoints are invalid" in err
    assert doc["version"] == 1 and doc["verified"] is True
    newest = doc["checkpoints"][0]
    assert newest["step"] == 2 and newest["valid"] is False and "checksum mismatch" in newest["reason"]
    assert doc["checkpoints"][1]["valid"] is True


def test_no_checkpoints_exits_3(url):
    """An unknown job (or an empty URL) exits 3 with a one-line message."""
    code, _, err = _run(url, "--job", "nope")
    assert code == 3 and "no checkpoints found" in err


def test_bad_job_or_option_exits_78():
    """A job name that could escape the prefix, or a malformed -o, is a config error."""
    assert _run("memory://x", "--job", "../etc")[0] == EX_CONFIG
    assert _run("memory://x", "-o", "novalue")[0] == EX_CONFIG


def test_storage_options_parse_json_values():
    """-o values are JSON when they parse (booleans, numbers), else strings."""
    assert parse_storage_options(["anon=true", "endpoint_url=http://h:1", "n=3"]) == {
        "anon": True, "endpoint_url": "http://h:1", "n": 3}
    with pytest.raises(ConfigError):
        parse_storage_options(["=x"])


def test_cli_entry_point_wires_the_subcommand(url, capsys):
    """`elasticd checkpoints` is reachable through the main CLI."""
    from elasticd.cli import main

    assert main(["checkpoints", url, "--job", "b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"][0]["step"] == 5


def test_verify_loads_the_state_file_as_the_loader_does(url):
    """--verify says no to a state.pt whose CRC and size match its manifest but which
    weights_only loading refuses (a pickle of an arbitrary object), as the loader would."""
    import dataclasses
    import datetime

    from elasticd.checkpoint.manifest import MANIFEST_NAME, FileEntry, checksum

    mgr = CheckpointManager(url, job="a")
    save = mgr.store.list_saves()[0]
    base = mgr.store.save_path(save.step, save.save_id)
    buf = io.BytesIO()
    torch.save({"w": datetime.datetime(2026, 1, 1)}, buf)  # not weights_only-loadable
    bad = buf.getvalue()
    mgr.store.fs.pipe_file(f"{base}/{STATE_FILE}", bad)
    manifest = mgr.store.read_manifest(save.step, save.save_id)
    files = tuple(FileEntry(STATE_FILE, len(bad), checksum(bad)) if f.name == STATE_FILE else f
                  for f in manifest.files)
    mgr.store.fs.pipe_file(f"{base}/{MANIFEST_NAME}", dataclasses.replace(manifest, files=files).to_json())
    assert _run(url, "--job", "a")[0] == 0  # sizes and manifest verify
    code, out, _ = _run(url, "--job", "a", "--verify", "--json")
    doc = json.loads(out)
    bad_rows = [c for c in doc["checkpoints"] if not c["valid"]]
    assert code == 1 and len(bad_rows) == 1 and "weights_only" in bad_rows[0]["reason"], out
