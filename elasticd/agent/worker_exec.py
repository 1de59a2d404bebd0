"""Worker launcher: ``python -m elasticd.agent.worker_exec [-m] TARGET [ARGS...]``.

The agent starts every worker through this module instead of ``python TARGET`` so that,
before the user's code runs, the worker:

- asks the kernel to SIGKILL it when the agent dies (``PR_SET_PDEATHSIG``), so even
  ``kill -9`` of the agent leaves no worker holding a GPU and a rank;
- registers ``faulthandler`` on SIGUSR1, so the agent can ask a hung worker for the
  stacks of all its threads (they land in the worker's stderr log);
- records an uncaught exception in torch's error file (``TORCHELASTIC_ERROR_FILE``) so the
  agent's failure summary shows the real traceback.

Then it runs TARGET exactly as ``python TARGET`` would (``__main__``, ``sys.argv``,
``sys.path[0]``), in the same process: no second interpreter start-up.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys

from elasticd.process import die_with_parent


def main(argv: list[str]) -> None:
    agent_pid = os.environ.get("ELASTICD_AGENT_PID")
    die_with_parent(int(agent_pid) if agent_pid else None)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python -m elasticd.agent.worker_exec [-m] TARGET [ARGS...]\n")
        raise SystemExit(2)
    target, args = argv[0], argv[1:]
    try:
        if as_module:
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(exc)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
