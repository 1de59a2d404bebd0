"""Workers under their own uid (``workers.user``): the agent's side.

The agent runs as root; training code must not (it would read the etcd client key and own
the control plane). With ``workers.user`` set, the agent checks at start, before anything
of the job is touched (each refusal exits 78 naming the fix):

- it runs as root (only root may switch users);
- the user exists and is not root (uid 0 would hand training code the control plane);
- a local checkpoint directory is writable by that user (created for it when missing).

Then every worker gets ``ELASTICD_RUN_AS=NAME:UID:GID`` and the user's ``HOME``, ``USER``
and ``LOGNAME``; the launcher (``elasticd.agent.worker_exec``), still root, takes the
user's groups (``os.initgroups``: the GPU device groups come with the user), gid and uid
before anything else. The control directory is shared with the user's group
(:meth:`elasticd.control.server.ControlChannel.share_with`). See docs/security.md.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from elasticd.control.api import ENV_RUN_AS
from elasticd.control.environment import RunAs
from elasticd.errors import ConfigError


@dataclass(frozen=True)
class WorkerUser:
    """A resolved ``workers.user``."""

    run_as: RunAs
    home: str
    groups: tuple[int, ...]  # every gid the user's workers hold (primary first)

    def env(self) -> dict[str, str]:
        """What every worker gets for this user (on top of the agent's own). Pure."""
        name = self.run_as.name
        # PYTHONSAFEPATH: the launcher and the standbys import elasticd and torch as root,
        # before the switch; the working directory (the user may write it) must not be on
        # their sys.path (worker_exec removes the variable again after the switch).
        return {ENV_RUN_AS: self.run_as.to_env(), "HOME": self.home, "USER": name,
                "LOGNAME": name, "PYTHONSAFEPATH": "1"}


def resolve_worker_user(name: str, *, euid: int,
                        getpwnam: Callable[[str], pwd.struct_passwd] = pwd.getpwnam,
                        getgrouplist: Callable[[str, int], list[int]] = os.getgrouplist,
                        ) -> WorkerUser:
    """The user ``workers.user`` names, checked. Pure but for the two look-ups.

    Raises:
        ConfigError: the agent is not root (``euid``), the user does not exist, or it is
            root (uid 0).
    """
    if sys.version_info < (3, 11):
        raise ConfigError(
            f"workers.user needs Python 3.11 or later (this is {sys.version.split()[0]}): the "
            "launcher imports elasticd as root before the switch, and only PYTHONSAFEPATH "
            "(3.11) keeps the workers' working directory off that import path")
    if euid != 0:
        raise ConfigError(
            f"workers.user = {name!r} needs the agent to run as root (it runs as uid {euid}): "
            "only root can start processes as another user. Run the agent as root (e.g. the "
            "systemd unit without User=), or unset workers.user / --workers-user")
    try:
        entry = getpwnam(name)
    except KeyError:
        raise ConfigError(f"workers.user = {name!r}: no such user on this node; create it "
                          f"(`useradd --system {name}`, with the GPU device groups, e.g. "
                          "`-G video,render`) or name an existing one") from None
    if entry.pw_uid == 0:
        raise ConfigError(
            f"workers.user = {name!r} is uid 0: workers as root could read the etcd client key "
            "and stop or rewind the job. Name an unprivileged user (its own, not nobody's, is best)")
    groups = tuple(dict.fromkeys([entry.pw_gid, *getgrouplist(name, entry.pw_gid)]))
    return WorkerUser(RunAs(name=name, uid=entry.pw_uid, gid=entry.pw_gid),
                      home=entry.pw_dir, groups=groups)


def local_checkpoint_dir(url: str | None) -> str | None:
    """The directory of a local (``file://`` or plain path) checkpoint URL, else None. Pure."""
    if not url:
        return None
    if url.startswith("file://"):
        return url[len("file://"):] or "/"
    return None if "://" in url else url


def user_may(st: os.stat_result, uid: int, gids: Iterable[int], bits: int) -> bool:
    """Whether ``uid`` (with ``gids``) has every permission in ``bits`` (``0o7`` scale:
    4 read, 2 write, 1 search) on a file with ``st``. Pure."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == uid:
        have = mode >> 6
    elif st.st_gid in set(gids):
        have = mode >> 3
    else:
        have = mode
    return have & bits == bits


def check_checkpoint_dir(url: str | None, job: str, user: WorkerUser) -> str | None:
    """Make sure ``user``'s workers can write the job's local checkpoints.

    A missing root directory is created (0700) owned by the user; an existing one, or the
    job's directory in it, must be writable by the user, and every level above searchable.

    Returns:
        What was created (for the log), or None.

    Raises:
        ConfigError: the directory exists and the user cannot write it (naming the fix).
    """
    root = local_checkpoint_dir(url)
    if root is None:
        return None
    root = os.path.abspath(root)
    uid, gids, name = user.run_as.uid, user.groups, user.run_as.name
    created = None
    if not os.path.lexists(root):
        os.makedirs(root, mode=0o700)
        os.chown(root, uid, user.run_as.gid)
        created = root
    job_dir = os.path.join(root, job)
    target = job_dir if os.path.isdir(job_dir) else root
    parent = os.path.dirname(target)
    while True:
        if not user_may(os.stat(parent), uid, gids, 1):
            raise ConfigError(
                f"checkpoint directory {target}: {parent} is not searchable by workers.user "
                f"{name!r}; `chmod o+x {parent}` or move the checkpoints under a directory "
                "that user can reach")
        if parent == os.path.dirname(parent):
            break
        parent = os.path.dirname(parent)
    if not user_may(os.stat(target), uid, gids, 3):
        raise ConfigError(
            f"checkpoint directory {target} is not writable by workers.user {name!r} "
            f"(uid {uid}), so no worker could save: `chown -R {name} {target}` (or give "
            "its group write access)")
    return created
