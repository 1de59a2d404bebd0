"""Admission policy: what a job fingerprint compares, and who is refused (pure parts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticd.agent.admission import (
    AdmissionVerdict,
    decide,
    differences,
    make_fingerprint,
    refusal_message,
)
from elasticd.errors import ConfigError
from elasticd.records import JobFingerprint, NodeRecord


def _script(tmp_path: Path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text(body)
    return str(p)


def _fp(command: list[str], **kw: object) -> JobFingerprint:
    args: dict[str, object] = {"min_nodes": 1, "max_nodes": 3, "checkpoint_url": "file:///ck",
                               "live_reform": True, "now": 0.0}
    args.update(kw)
    return make_fingerprint(command, **args)  # type: ignore[arg-type]


def test_same_script_content_at_another_path_matches(tmp_path: Path) -> None:
    """Checkouts live in different directories per node: the path is not compared."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _fp([_script(tmp_path / "a", "train.py", "print(1)\n"), "--lr", "1"], node="n1")
    b = _fp([_script(tmp_path / "b", "train.py", "print(1)\n"), "--lr", "1"], node="n2")
    assert a.digest == b.digest
    assert decide(b, a, [a.digest]) is AdmissionVerdict.MATCH


def test_relative_script_is_found_in_the_workdir(tmp_path: Path) -> None:
    """A relative script path is read from the worker workdir, not the agent's cwd."""
    _script(tmp_path, "train.py", "x = 1\n")
    assert _fp(["train.py"], workdir=str(tmp_path)).program.startswith("sha256:")


@pytest.mark.parametrize("change", [
    {"command_body": "print(2)\n"}, {"args": ["--lr", "2"]}, {"min_nodes": 2},
    {"max_nodes": 4}, {"checkpoint_url": "file:///other"}, {"live_reform": False},
    {"version": "0.0.0-other"},
])
def test_each_compared_setting_changes_the_digest(tmp_path: Path, change: dict[str, object]) -> None:
    """Script content, args, min/max, checkpoint URL, live mode and version must agree."""
    base_script = _script(tmp_path, "train.py", "print(1)\n")
    base = _fp([base_script, "--lr", "1"])
    body = change.pop("command_body", None)
    script = _script(tmp_path, "other.py", str(body)) if body is not None else base_script
    args = change.pop("args", ["--lr", "1"])
    other = _fp([script, *args], **change)  # type: ignore[misc]
    assert other.digest != base.digest
    assert len(differences(other, base)) == 1


def test_node_local_settings_are_not_compared(tmp_path: Path) -> None:
    """The publisher's node name and time are shown, never compared."""
    s = _script(tmp_path, "train.py", "pass\n")
    assert _fp([s], node="a", now=1.0).digest == _fp([s], node="b", now=2.0).digest


def test_module_commands_compare_the_module_name(tmp_path: Path) -> None:
    """``-m pkg.train`` is compared by name (the module is not imported to hash it)."""
    a, b = _fp(["-m", "pkg.train", "--x"]), _fp(["-m", "pkg.other", "--x"])
    assert a.program == "module:pkg.train"
    assert a.digest != b.digest
    assert differences(b, a) == ["program: the program differs (module:pkg.train vs module:pkg.other)"]


def test_unreadable_script_is_a_config_error(tmp_path: Path) -> None:
    """A script that cannot be read names the path."""
    with pytest.raises(ConfigError, match="missing.py"):
        _fp([str(tmp_path / "missing.py")])


def test_decide_publishes_matches_refuses_and_replaces(tmp_path: Path) -> None:
    """Refused only while a live agent runs the stored fingerprint; else it is replaced."""
    job = _fp([_script(tmp_path, "a.py", "a\n")])
    foreign = _fp([_script(tmp_path, "b.py", "b\n")])
    assert decide(foreign, None, []) is AdmissionVerdict.PUBLISH
    assert decide(job, job, []) is AdmissionVerdict.MATCH
    assert decide(foreign, job, [job.digest]) is AdmissionVerdict.REFUSE
    # The run ended (no live holder), or the live nodes already run the new command.
    assert decide(foreign, job, []) is AdmissionVerdict.REPLACE
    assert decide(foreign, job, [foreign.digest, ""]) is AdmissionVerdict.REPLACE


def test_refusal_names_both_commands_the_difference_and_the_fix(tmp_path: Path) -> None:
    """The 78 message says what runs, what was given, what differs and how to fix it."""
    job = _fp([_script(tmp_path, "a.py", "a\n"), "--lr", "1"], node="n1")
    foreign = _fp([_script(tmp_path, "b.py", "b\n"), "--lr", "1"], max_nodes=4)
    msg = refusal_message("demo", foreign, job, ["n1", "n2"])
    assert "a.py --lr 1" in msg and "b.py --lr 1" in msg
    assert "script's content differs" in msg and "max_nodes: 3 (job) vs 4" in msg
    assert "--job" in msg and "elasticd stop --job demo" in msg and "n1, n2" in msg


def test_fingerprint_and_node_record_round_trip(tmp_path: Path) -> None:
    """The stored record decodes to the same fingerprint; node records carry the digest."""
    fp = _fp([_script(tmp_path, "a.py", "a\n"), "--x"], checkpoint_url="s3://u:p@b/ck?k=v")
    back = JobFingerprint.from_json(fp.to_json())
    assert back == fp and "u:p" not in fp.to_json()
    rec = NodeRecord(node="n", host="h", pid=1, version="v", started_at=0.0,
                     fingerprint=fp.digest)
    assert NodeRecord.from_json(rec.to_json()).fingerprint == fp.digest
    old = {k: v for k, v in json.loads(rec.to_json()).items() if k != "fingerprint"}
    assert NodeRecord.from_json(json.dumps(old)).fingerprint == ""  # an older agent's record
