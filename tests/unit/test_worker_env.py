"""What workers inherit from the agent: the group's variables, never an etcd credential."""

from __future__ import annotations

import pytest

from elasticd.agent.worker_env import is_secret, scrub, spawn_environment


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
