"""The hand-over lines an agent writes to a process started ahead (elasticd.control.handover)."""

from __future__ import annotations

import io
import json

import pytest

from elasticd.control import handover
from elasticd.control.api import ENV_CONTROL_SOCKET, ENV_SPARE
from elasticd.control.environment import agent_environment
from elasticd.errors import ConfigError


def test_a_spare_line_marks_the_environment_and_carries_the_command():
    line = handover.message({"A": "1"}, argv=["train.py"], cwd="/w", spare=True)
    doc = json.loads(line)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert doc == {"env": {"A": "1", ENV_SPARE: "1"}, "argv": ["train.py"], "cwd": "/w",
                   "stdout": None, "stderr": None, "spare": True}


def test_the_admission_line_is_the_round_environment_and_the_logs_only():
    doc = json.loads(handover.message({"RANK": "3"}, stdout="/o", stderr="/e"))
    assert doc == {"env": {"RANK": "3"}, "stdout": "/o", "stderr": "/e", "argv": None,
                   "cwd": None, "spare": False}


def test_read_returns_none_at_the_end_of_the_stream():
    stream = io.BytesIO(handover.message({"X": "y"}))
    assert handover.read(stream) == handover.Handover(env={"X": "y"})
    assert handover.read(stream) is None


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("line", "field"), [
    (b'{"env": {"A": 1}}', r"hand-over line\.env\['A'\]: expected str"),
    (b'{"env": {}, "argv": "train.py"}', r"\.argv: expected an array"),
    (b'{"env": {}, "spare": 1}', r"\.spare: expected bool"),
    (b'{"stdout": "/o"}', r"field 'env' is missing"),
    (b'[' * 100 + b']' * 100, "deeper than"),
    (b"not json", "hand-over line"),
])
def test_a_malformed_hand_over_line_is_refused_naming_the_field(line, field):
    """A hand-over line is validated field by field (it was a bare json.loads that let a
    wrong type reach os.environ or exec): the error names the field, or the bound broken."""
    from elasticd.codec import RecordDecodeError

    with pytest.raises(RecordDecodeError, match=field):
        handover.read(io.BytesIO(line + b"\n"))


def test_asking_for_the_round_before_a_spare_is_admitted_names_the_contract():
    """A CheckpointManager (or anything reading the agent's round) built before the
    worker API waited for the round fails with a ConfigError saying what to do, not
    with the generic missing-ELASTICD_ROUND error."""
    with pytest.raises(ConfigError, match="runs ahead of its round as a hot spare's"):
        agent_environment({ENV_CONTROL_SOCKET: "/run/x.sock", ENV_SPARE: "1"})
    assert agent_environment({ENV_CONTROL_SOCKET: "/run/x.sock", ENV_SPARE: "1",
                              "ELASTICD_ROUND": "4"}).round == 4
