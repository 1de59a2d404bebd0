"""The control channel's contract: environment variables, runtime-directory names, and the
three-valued outcome of a checkpoint commit (re-exported by ``elasticd.checkpoint``, whose
fence contract it is; defined here so that the worker API need not import the checkpoint
package, and storage libraries with it, to talk to its agent).

Both sides import these names from here, so neither the agent (``elasticd.agent``) nor
the worker API (``elasticd.worker``) imports the other. See the package docstring for the
protocol.
"""

from __future__ import annotations

import enum

# Environment an agent hands its workers (and nothing else from the agent's own config:
# see ``elasticd.agent.elastic_agent.scrub_secrets``).
ENV_CONTROL_DIR = "ELASTICD_CONTROL_DIR"
ENV_CONTROL_SOCKET = "ELASTICD_CONTROL_SOCKET"
ENV_ROUND = "ELASTICD_ROUND"
ENV_JOB = "ELASTICD_JOB"
ENV_NODE = "ELASTICD_NODE"
ENV_AGENT_PID = "ELASTICD_AGENT_PID"
ENV_CHECKPOINT_URL = "ELASTICD_CHECKPOINT_URL"
ENV_LOG_FORMAT = "ELASTICD_LOG_FORMAT"  # "json" when the agent logs JSON (else unset)
ENV_RUN_ID = "ELASTICD_RUN_ID"  # this run's identity (docs/checkpoints.md)
ENV_RESUME = "ELASTICD_RESUME"  # what to do with another run's checkpoints: auto/require/never
# ``[checkpoint] every`` ("auto" or steps; the same name as the agent's own variable for it)
# and the losses the goodput ledger counted, "<losses>/<observed seconds>" (checkpoint.cadence).
ENV_CHECKPOINT_EVERY = "ELASTICD_CHECKPOINT_EVERY"
ENV_OBSERVED_LOSSES = "ELASTICD_OBSERVED_LOSSES"
# "1": this worker runs ahead of its round as a hot spare's (elasticd.control.handover):
# its script builds the model, then the worker API waits for the round on stdin.
ENV_SPARE = "ELASTICD_SPARE"
# "NAME:UID:GID" (``workers.user``): the launcher, still root, switches to this user before
# anything else (elasticd.agent.worker_exec, parsed by elasticd.control.environment.run_as).
ENV_RUN_AS = "ELASTICD_RUN_AS"

# Files in the runtime directory (mode 0700).
DRAIN_FILE = "drain"
SOCKET_FILE = "control.sock"
STOPPED_PREFIX = "stopped-"
DRAINABLE_PREFIX = "drainable-"
# Written by the worker API's ``init()`` (elasticd.worker), before the process group forms:
# "this worker uses the worker API" (it may register for live re-formation). A group whose
# workers run without one is a plain script's (docs/failure-model.md, "How a join is handled").
API_PREFIX = "api-"
# Written by the launcher (elasticd.agent.worker_exec) when the worker's script returned
# with status 0, just before the process ends: "this rank completed its work", so an abort
# or a hang in torch's teardown after it is not a failure and never re-runs the script.
DONE_PREFIX = "done-"


class CommitOutcome(enum.Enum):
    """What became of one commit: the fence's answer has three values, not two.

    - ``COMMITTED``: the pointer names the checkpoint now.
    - ``REFUSED``: the fence compared and said no (the writer's round is over, or a newer
      checkpoint is committed): the writer is a zombie or late; its upload may be deleted.
    - ``UNKNOWN``: no answer (etcd unreachable or slow, the agent busy, any other error).
      The upload is kept, nothing is raised, training goes on; the agent retries the commit
      and the pointer catches up once etcd answers. Nothing is ever deleted on a guess.

    ``bool(outcome)`` is True only for ``COMMITTED``, so code written against the old
    boolean contract (``if fence.commit(...)``) keeps its meaning for that case.
    """

    COMMITTED = "committed"
    REFUSED = "refused"
    UNKNOWN = "unknown"

    def __bool__(self) -> bool:
        return self is CommitOutcome.COMMITTED

    @classmethod
    def of(cls, value: CommitOutcome | bool) -> CommitOutcome:
        """Normalise a fence's answer: a legacy ``bool`` means committed or refused."""
        if isinstance(value, CommitOutcome):
            return value
        return cls.COMMITTED if value else cls.REFUSED

# Live re-formation (elasticd.control.reform): the worker group re-forms in place.
ENV_LIVE = "ELASTICD_LIVE"  # "1": the agent re-forms live workers in place on a membership change
# Seconds one live re-formation may take on the worker's side (``workers.live_reform_timeout_s``,
# the agent's own bound for the same re-formation): past it the worker falls back to a restart.
ENV_LIVE_TIMEOUT = "ELASTICD_LIVE_TIMEOUT_S"
LIVE_TIMEOUT_DEFAULT_S = 30.0  # = the schema's default of workers.live_reform_timeout_s


def live_worker_env(live_reform: bool, live_reform_timeout_s: float) -> dict[str, str]:
    """The live re-formation settings an agent hands its workers (empty when off). Pure."""
    if not live_reform:
        return {}
    return {ENV_LIVE: "1", ENV_LIVE_TIMEOUT: repr(float(live_reform_timeout_s))}
PARK_FILE = "park"  # the agent asks live workers to leave their group at the next agreed step
REFORM_FILE = "reform.json"  # the agent's order: the new round's ranks and bootstrap address
