"""``workers.user``'s pure parts: the config key and flag, the agent's checks (each exit 78),
the environment a worker gets and parses, and the agent's writes and reads in a control
directory the workers may write."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import pytest

from elasticd.agent.summary import _read
from elasticd.agent.worker_exec import become_worker_user
from elasticd.agent.worker_user import (
    WorkerUser,
    check_checkpoint_dir,
    local_checkpoint_dir,
    resolve_worker_user,
    user_may,
)
from elasticd.config import load_config
from elasticd.control.api import DRAIN_FILE, ENV_RUN_AS
from elasticd.control.environment import RunAs, run_as
from elasticd.control.messages import StoppedReport
from elasticd.control.reform import read_stopped, write_atomic, write_stopped
from elasticd.control.server import ControlChannel
from elasticd.errors import ConfigError


def _pw(name: str, uid: int, gid: int = 100, home: str = "/home/x") -> pwd.struct_passwd:
    return pwd.struct_passwd((name, "x", uid, gid, "", home, "/bin/sh"))


def _lookup(**users: pwd.struct_passwd):
    def getpwnam(name: str) -> pwd.struct_passwd:
        return users[name]
    return getpwnam


def test_the_key_comes_from_the_flag_the_env_and_the_file(tmp_path):
    base = {"job.name": "j", "workers.command": ("t.py",), "etcd.endpoints": "h:1"}
    conf = tmp_path / "a.toml"
    conf.write_text('[workers]\nuser = "t3"\n')
    assert load_config(None, {}, {**base, "workers.user": "trainer"},
                       check_files=False).workers.user == "trainer"
    assert load_config(None, {"ELASTICD_WORKERS_USER": "t2"}, base,
                       check_files=False).workers.user == "t2"
    assert load_config(str(conf), {}, base, check_files=False).workers.user == "t3"
    assert load_config(None, {}, base, check_files=False).workers.user is None


def test_the_agent_must_be_root():
    with pytest.raises(ConfigError, match="needs the agent to run as root"):
        resolve_worker_user("trainer", euid=1000, getpwnam=_lookup(trainer=_pw("trainer", 1001)))


def test_a_missing_user_and_root_are_refused():
    with pytest.raises(ConfigError, match="no such user"):
        resolve_worker_user("ghost", euid=0, getpwnam=_lookup())
    with pytest.raises(ConfigError, match="uid 0"):
        resolve_worker_user("toor", euid=0, getpwnam=_lookup(toor=_pw("toor", 0, 0)))


def test_the_user_brings_its_groups_and_its_environment():
    user = resolve_worker_user("trainer", euid=0, getpwnam=_lookup(trainer=_pw("trainer", 1001, 1001)),
                               getgrouplist=lambda name, gid: [gid, 44, 109])  # video, render
    assert user.run_as == RunAs("trainer", 1001, 1001) and user.groups == (1001, 44, 109)
    env = user.env()
    assert env == {ENV_RUN_AS: "trainer:1001:1001", "HOME": "/home/x", "USER": "trainer",
                   "LOGNAME": "trainer", "PYTHONSAFEPATH": "1"}
    assert run_as(env) == user.run_as  # what the launcher parses back


@pytest.mark.parametrize("raw", ["trainer", "trainer:0:0", "trainer:x:1", ":1:1", "t:1"])
def test_a_malformed_or_root_run_as_is_refused_by_the_worker(raw):
    with pytest.raises(ConfigError, match="NAME:UID:GID"):
        run_as({ENV_RUN_AS: raw})
    assert run_as({}) is None


def test_the_launcher_does_nothing_without_a_user_and_refuses_when_not_root():
    assert become_worker_user({}) is None
    if os.geteuid() == 0:
        return  # a root launcher would switch for real: the integration test covers it
    uid = os.getuid() + 1
    with pytest.raises(ConfigError, match="not root"):
        become_worker_user({ENV_RUN_AS: f"other:{uid}:{uid}"})


def test_local_checkpoint_dirs():
    assert local_checkpoint_dir("file:///ck") == "/ck"
    assert local_checkpoint_dir("/ck") == "/ck"
    assert local_checkpoint_dir("s3://b/ck") is None and local_checkpoint_dir(None) is None


def test_permission_bits_for_owner_group_and_others(tmp_path):
    st = os.stat(tmp_path)
    fake = os.stat_result((stat.S_IFDIR | 0o750, 0, 0, 0, 10, 20, 0, 0, 0, 0))
    assert user_may(fake, 10, [], 7) and user_may(fake, 11, [20], 5)
    assert not user_may(fake, 11, [20], 2) and not user_may(fake, 12, [], 1)
    assert user_may(st, st.st_uid, [], 3)


def _me(tmp_path: Path) -> WorkerUser:
    uid, gid = os.getuid(), os.getgid()
    return WorkerUser(RunAs("me", uid, gid), home=str(tmp_path), groups=(gid,))


def test_an_unwritable_checkpoint_dir_is_refused_naming_the_fix(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir(mode=0o555)  # the user's own, but read-only
    me = WorkerUser(RunAs("trainer", os.getuid(), os.getgid()), home="/", groups=(os.getgid(),))
    with pytest.raises(ConfigError, match=r"not writable by workers.user 'trainer'.*chown -R trainer"):
        check_checkpoint_dir(f"file://{ck}", "job", me)
    ck.chmod(0o700)
    assert check_checkpoint_dir(f"file://{ck}", "job", me) is None
    stranger = WorkerUser(RunAs("stranger", os.getuid() + 12345, os.getgid() + 12345), home="/",
                          groups=(os.getgid() + 12345,))
    tmp_path.chmod(0o700)
    with pytest.raises(ConfigError, match=r"is not searchable by workers.user 'stranger'"):
        check_checkpoint_dir(f"file://{ck}", "job", stranger)
    assert check_checkpoint_dir("s3://b/ck", "job", stranger) is None


def test_a_missing_checkpoint_dir_is_created_for_the_user(tmp_path):
    ck = tmp_path / "new" / "ck"
    assert check_checkpoint_dir(str(ck), "job", _me(tmp_path)) == str(ck)
    assert ck.is_dir() and stat.S_IMODE(ck.stat().st_mode) == 0o700


def test_the_agent_never_writes_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    (tmp_path / DRAIN_FILE).symlink_to(victim)
    (tmp_path / f"{DRAIN_FILE}.tmp").symlink_to(victim)  # the old fixed temporary name
    write_atomic(tmp_path / DRAIN_FILE, "stop")
    assert victim.read_text() == "root's file"
    assert (tmp_path / DRAIN_FILE).read_text() == "stop" and not (tmp_path / DRAIN_FILE).is_symlink()
    assert stat.S_IMODE((tmp_path / DRAIN_FILE).stat().st_mode) == 0o644  # the workers read it


def test_the_agent_reads_no_planted_symlink_as_a_worker_file(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_stopped(elsewhere, StoppedReport(rank=0, step=3, round=1))
    (tmp_path / "stopped-0").symlink_to(elsewhere / "stopped-0")
    write_stopped(tmp_path, StoppedReport(rank=1, step=3, round=1))
    assert sorted(read_stopped(tmp_path)) == [1]
    log = elsewhere / "stderr.log"
    log.write_text("secret")
    (tmp_path / "stderr.log").symlink_to(log)
    assert _read(str(tmp_path / "stderr.log")) == "" and _read(str(log)) == "secret"
    os.mkfifo(tmp_path / "fifo")
    assert _read(str(tmp_path / "fifo")) == ""  # no hang


def test_the_control_dir_is_shared_with_the_group_sticky(tmp_path):
    channel = ControlChannel(base_dir=str(tmp_path)).start()
    try:
        channel.share_with(os.getgid())
        st = channel.dir.stat()
        assert stat.S_IMODE(st.st_mode) == 0o1770 and st.st_gid == os.getgid()
        sock = os.stat(channel.socket_path)
        assert stat.S_IMODE(sock.st_mode) == 0o660 and sock.st_gid == os.getgid()
    finally:
        channel.close()
