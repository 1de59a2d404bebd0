"""The one seam between an agent and its workers: the per-node control channel.

The agent (``elasticd.agent``) serves it (``server.py``); the worker API
(``elasticd.worker``) is its client (``client.py``); both speak the typed messages of
``messages.py`` and use the names in ``api.py``. This package imports neither side, and
neither side imports the other (a unit test walks the imports to keep it so).

A private runtime directory (mode 0700) per agent, passed to workers as
``ELASTICD_CONTROL_DIR``:

- ``drain``: exists once the agent asks the job to stop at the next step boundary. A
  worker checks it with one ``stat`` per step (``elasticd.worker.should_stop``), then all
  ranks agree through one tiny all-reduce, so every rank of every node stops after the
  same step.
- ``stopped-<rank>`` (a typed ``StoppedReport``): written by a worker that exits 0
  because of a drain (its own node's or a peer's), with the last trained step. It tells the agent "stopped for a drain, the
  job is not finished", so a surviving node re-forms instead of declaring success.
- ``drainable-<rank>``: written by a worker the first time it calls ``should_stop`` (an
  empty file). It tells the agent "this worker group stops at a step boundary when asked",
  so a node joining mid-training is admitted through a drain (no step lost) rather than by
  killing the workers.
- ``control.sock``: a Unix stream socket, one JSON object per line (``messages.py``):
  ``progress`` (no reply; hang detection and status), ``checkpoint_io`` (no reply: a
  save or load the workers did, for the agent's metrics), ``commit`` (the fenced checkpoint
  commit, done by the agent because only it knows whether its round is still current;
  the reply's outcome is committed, refused or unknown), ``latest`` (the committed
  pointer), ``ping``; for live re-formation the workers' reports (``live``, ``parked``,
  ``reformed``, kept by the agent per local rank) and ``await_order`` (answered when the
  agent publishes an order in ``reform.json``: see ``reform.py``).
"""

from elasticd.control.api import (
    API_PREFIX,
    DONE_PREFIX,
    DRAIN_FILE,
    DRAINABLE_PREFIX,
    ENV_CONTROL_DIR,
    ENV_CONTROL_SOCKET,
    ENV_ROUND,
    SOCKET_FILE,
    STOPPED_PREFIX,
)
from elasticd.control.client import ControlClient
from elasticd.control.messages import (
    CheckpointIo,
    CheckpointIoKind,
    CommitReply,
    CommitRequest,
    DivergenceReport,
    ErrorReply,
    LatestReply,
    LatestRequest,
    MessageError,
    Ping,
    Pong,
    StepReport,
    parse_reply,
    parse_request,
    serialise,
)
from elasticd.control.server import ControlChannel, ProgressBoard, RankProgress

__all__ = [
    "API_PREFIX",
    "DONE_PREFIX",
    "DRAINABLE_PREFIX",
    "DRAIN_FILE",
    "ENV_CONTROL_DIR",
    "ENV_CONTROL_SOCKET",
    "ENV_ROUND",
    "SOCKET_FILE",
    "STOPPED_PREFIX",
    "CheckpointIo",
    "CheckpointIoKind",
    "CommitReply",
    "CommitRequest",
    "ControlChannel",
    "ControlClient",
    "DivergenceReport",
    "ErrorReply",
    "LatestReply",
    "LatestRequest",
    "MessageError",
    "Ping",
    "Pong",
    "StepReport",
    "ProgressBoard",
    "RankProgress",
    "parse_reply",
    "parse_request",
    "serialise",
]
