"""What workers inherit from the agent: the group's variables, never an etcd credential."""

from __future__ import annotations

import pytest

from elasticd.agent.supervision import SupervisionSettings
from elasticd.agent.worker_env import is_secret, scrub, spawn_environment, supervised_worker_env
from elasticd.control.environment import agent_environment
from elasticd.errors import ConfigError


@pytest.mark.parametrize("name", [
    "ELASTICD_ETCD_ENDPOINTS", "ELASTICD_ETCD_USER", "ELASTICD_ETCD_PASSWORD",
    "ELASTICD_ETCD_PASSWORD_FILE", "ELASTICD_ETCD_CA_FILE", "ELASTICD_ETCD_CERT_FILE",
    "ELASTICD_ETCD_KEY_FILE", "ELASTICD_CONFIG", "ELASTICD_S3_SECRET", "ELASTICD_API_TOKEN",
    "ETCDCTL_PASSWORD",
])
def test_credentials_are_secret(name):
    """Every etcd credential, the config path and secret-looking ELASTICD_* names are scrubbed."""
    assert is_secret(name)


@pytest.mark.parametrize("name", [
    "ELASTICD_ROUND", "ELASTICD_JOB", "ELASTICD_NODE", "ELASTICD_CONTROL_DIR",
    "ELASTICD_CONTROL_SOCKET", "ELASTICD_CHECKPOINT_URL", "ELASTICD_AGENT_PID", "PATH",
    "OMP_NUM_THREADS", "MY_API_KEY",
])
def test_worker_contract_is_not_secret(name):
    """The variables workers need (and the user's own) pass through."""
    assert not is_secret(name)


def test_spawn_environment_sets_scrubs_and_restores():
    """During the spawn the environment holds the group's variables and no secret; after it,
    exactly what it held before."""
    env = {"PATH": "/bin", "ELASTICD_ETCD_PASSWORD": "hunter2", "ELASTICD_ROUND": "1"}
    before = dict(env)
    with spawn_environment({"ELASTICD_ROUND": "4", "ELASTICD_ETCD_USER": "root", "X": "y"}, env):
        assert env == {"PATH": "/bin", "ELASTICD_ROUND": "4", "X": "y"}
    assert env == before
    assert scrub({"ELASTICD_ETCD_ENDPOINTS": "h:1", "A": "b"}) == {"A": "b"}


def test_the_checkpoint_cadence_and_the_ledgers_losses_reach_the_worker():
    """[checkpoint] every and the agent's loss count travel in the worker's environment and
    parse back on the worker's side; unset, neither variable is set."""
    env = supervised_worker_env(SupervisionSettings(checkpoint_every="auto"), job="j", node="n",
                                agent_pid=1, control_env={"ELASTICD_CONTROL_SOCKET": "/s"},
                                losses=(3, 7200.4))
    assert env["ELASTICD_CHECKPOINT_EVERY"] == "auto"
    assert env["ELASTICD_OBSERVED_LOSSES"] == "3/7200"
    seen = agent_environment({**env, "ELASTICD_ROUND": "2"})
    assert seen is not None and seen.checkpoint_every == "auto"
    assert seen.observed_losses == (3, 7200.0)
    fixed = supervised_worker_env(SupervisionSettings(checkpoint_every="200"), job="j", node="n",
                                  agent_pid=1, control_env={})
    assert fixed["ELASTICD_CHECKPOINT_EVERY"] == "200" and "ELASTICD_OBSERVED_LOSSES" not in fixed
    unset = supervised_worker_env(SupervisionSettings(), job="j", node="n", agent_pid=1,
                                  control_env={}, losses=(1, 5.0))
    assert not {"ELASTICD_CHECKPOINT_EVERY", "ELASTICD_OBSERVED_LOSSES"} & set(unset)
    with pytest.raises(ConfigError, match=r"\[checkpoint\] every"):
        agent_environment({"ELASTICD_CONTROL_SOCKET": "/s", "ELASTICD_ROUND": "2",
                           "ELASTICD_CHECKPOINT_EVERY": "often"})
