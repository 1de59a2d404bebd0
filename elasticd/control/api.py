"""The control channel's contract: environment variables and runtime-directory names.

Both sides import these names from here, so neither the agent (``elasticd.agent``) nor
the worker API (``elasticd.worker``) imports the other. See the package docstring for the
protocol.
"""

from __future__ import annotations

# Environment an agent hands its workers (and nothing else from the agent's own config:
# see ``elasticd.agent.elastic_agent.scrub_secrets``).
ENV_CONTROL_DIR = "ELASTICD_CONTROL_DIR"
ENV_CONTROL_SOCKET = "ELASTICD_CONTROL_SOCKET"
ENV_ROUND = "ELASTICD_ROUND"
ENV_JOB = "ELASTICD_JOB"
ENV_NODE = "ELASTICD_NODE"
ENV_AGENT_PID = "ELASTICD_AGENT_PID"
ENV_CHECKPOINT_URL = "ELASTICD_CHECKPOINT_URL"

# Files in the runtime directory (mode 0700).
DRAIN_FILE = "drain"
SOCKET_FILE = "control.sock"
STOPPED_PREFIX = "stopped-"
DRAINABLE_PREFIX = "drainable-"
