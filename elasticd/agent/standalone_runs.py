"""Re-running a ``--standalone`` job in the same directory: continue it, or start a new run.

Why: every ``elasticd run --standalone`` starts a fresh private etcd, so every start used
to be a new run (a new run id), and the second start of the README's own command met the
first one's checkpoints and failed (ForeignCheckpointError, exit 78) after the workers had
started. A standalone job's name is derived from its script and directory, so the agent
keeps, per job, a small local record of its last run: the run id, the checkpoint URL and
how it ended. The next standalone start of the same job decides from it, before anything
starts (:func:`plan_standalone_run`, pure):

- the last run ended by a stop, a drain, Ctrl-C, a failure, or the agent died: continue
  it (the same run id, so its checkpoints are this run's own) and say so;
- the last run finished: start a new run (a new run id, ``--resume never`` beside the
  finished run's checkpoints, which are kept untouched: never loaded, never pruned) and say
  so, as torchrun runs the script again.

The record lives under ``$STATE_DIRECTORY/standalone-runs/`` (else
``<tmp>/elasticd-<uid>/standalone-runs/``), private to the user. Without it (removed, or
written before this existed) the checkpoint check refuses with one line naming
``--resume``, as before. ``--resume never`` always starts a new run; ``--resume require``
continues even a finished one. A continued run keeps the resume mode it started with (a
new run after a finished one stays ``never``: it must not take the old run's saves).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from elasticd import boundedjson
from elasticd.checkpoint.identity import RESUME_MODES
from elasticd.checkpoint.manifest import RUN_ID_RE
from elasticd.etcd.endpoints import TLSFiles
from elasticd.logs import default_state_root, ensure_private_tree

RUNNING = "running"  # written at start: an agent killed outright leaves it so
FINISHED = "finished"
DONE = frozenset({FINISHED, "closed"})  # outcome kinds of a run that is over
# How a run that did not finish ended, in the words the continuation line uses.
ENDINGS = {
    RUNNING: "its agent was killed or crashed",
    "drained": "it was stopped (stop, drain or Ctrl-C)",
    "failed": "its workers failed",
}


@dataclass(frozen=True)
class RunRecord:
    """The last run of one standalone job, as its agent left it."""

    run_id: str
    checkpoint_url: str
    outcome: str  # RUNNING, FINISHED, or an agent outcome kind ("drained", "failed")
    resume: str = "auto"  # the resume mode the run started with (a continuation keeps it)


@dataclass(frozen=True)
class RunPlan:
    """What a standalone start does about its job's last run.

    Attributes:
        run_id: the run id to use (the last run's to continue it, ``fresh_run_id`` for a new
            run after a finished one), or None for a new one of the agent's making.
        resume: the resume mode this run uses: the given one, ``never`` for a new run beside
            a finished run's checkpoints, or the continued run's own.
        anew: a new run after a finished one (``message`` says so).
        message: the one line to print (continuing, or a new run), or "" (a new run).
    """

    run_id: str | None = None
    resume: str = "auto"
    anew: bool = False
    message: str = ""


def plan_standalone_run(record: RunRecord | None, *, job: str, checkpoint_url: str | None,
                        resume: str, fresh_run_id: str) -> RunPlan:
    """Decide whether a standalone start continues its job's last run or starts a new one. Pure.

    Args:
        record: the job's last run (:func:`read_record`), or None.
        job: the job name.
        checkpoint_url: this start's checkpoint URL (a record for another URL is not used).
        resume: ``auto``, ``require`` or ``never`` (``job.resume``).
        fresh_run_id: the run id of a new run after a finished one (named in its line).

    Returns:
        The :class:`RunPlan`.
    """
    if (record is None or checkpoint_url is None or resume == "never"
            or record.checkpoint_url != checkpoint_url):
        return RunPlan(resume=resume)
    if record.outcome in DONE and resume != "require":
        return RunPlan(run_id=fresh_run_id, resume="never", anew=True, message=(
            f"elasticd: job {job} finished before (run {record.run_id}): starting new run "
            f"{fresh_run_id}; the finished run's checkpoints under {checkpoint_url} are kept "
            "untouched. To train on from them instead pass --resume require"))
    how = ENDINGS.get(record.outcome, f"it ended: {record.outcome}")
    if record.outcome in DONE:
        how = "it finished; --resume require"
    kept = "never" if record.resume == "never" and resume != "require" else resume
    return RunPlan(run_id=record.run_id, resume=kept, message=(
        f"elasticd: continuing run {record.run_id} of job {job} ({how}); its checkpoints under "
        f"{checkpoint_url} are resumed. To start a new run instead pass --resume never or "
        "--job NEW-NAME"))


#: A record is a few hundred bytes; anything larger is not one of ours.
MAX_RECORD_BYTES = 64 * 1024


def records_dir(state_dir: str | None, state_home: str | None = None) -> str:
    """The private directory of the records: ``$STATE_DIRECTORY/standalone-runs``, else
    ``<state home>/standalone-runs`` (``$XDG_STATE_HOME/elasticd``, else
    ``~/.local/state/elasticd``), every level 0700 and checked with lstat, as the commit
    intents' (never a predictable name in a shared temp dir another user could make first).

    Raises:
        ConfigError: another user controls it, or it cannot be created.
    """
    what = ("standalone run records dir",
            "$STATE_DIRECTORY (systemd StateDirectory=) or $XDG_STATE_HOME")
    if state_dir:
        return ensure_private_tree(os.path.abspath(state_dir.split(":")[0]),
                                   ("standalone-runs",), what)
    return ensure_private_tree(state_home or default_state_root(None, None),
                               ("standalone-runs",), what)


def read_record(directory: str, job: str) -> RunRecord | None:
    """The job's record, or None when there is none or it is not one (never trusted blindly:
    a record that does not parse, or whose run id is malformed, is ignored)."""
    try:
        data = boundedjson.loads_object(
            boundedjson.read_file(Path(directory) / f"{job}.json", max_bytes=MAX_RECORD_BYTES),
            what="standalone run record", max_bytes=MAX_RECORD_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    run_id, url, outcome = data.get("run_id"), data.get("checkpoint_url"), data.get("outcome")
    resume = data.get("resume", "auto")  # absent: written before runs kept their mode
    if not (isinstance(run_id, str) and RUN_ID_RE.fullmatch(run_id) and isinstance(url, str)
            and isinstance(outcome, str) and resume in RESUME_MODES):
        return None
    return RunRecord(run_id, url, outcome, resume)


def write_record(directory: str, job: str, record: RunRecord) -> None:
    """Replace the job's record atomically (write, then rename)."""
    path = Path(directory) / f"{job}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"run_id": record.run_id, "checkpoint_url": record.checkpoint_url,
                               "outcome": record.outcome, "resume": record.resume,
                               "updated_at": time.time()}),
                   encoding="utf-8")
    os.replace(tmp, path)


def status_command(job: str, endpoint: str, tls: TLSFiles | None) -> str:
    """The ``elasticd status`` command line for a job on a private etcd, ready to paste
    (its endpoint and the generated client certificate's three files). Pure."""
    argv = ["elasticd", "status", "--etcd", endpoint]
    if tls is not None:
        for flag, path in (("--etcd-ca", tls.ca_file), ("--etcd-cert", tls.cert_file),
                           ("--etcd-key", tls.key_file)):
            if path:
                argv += [flag, path]
    return shlex.join([*argv, "--job", job])
