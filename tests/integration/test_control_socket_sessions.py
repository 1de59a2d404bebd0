"""The agent's control socket against forked children: 300 children of one worker (one
session) hold at most MAX_CONNECTIONS_PER_SESSION connections, and a worker of another
session still gets its ping answered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

# A worker that forks 300 children; each connects, pings and holds its connection until
# the worker reads a line on stdin. Prints how many children were answered.
HOARD = """\
import os, socket, sys
path = sys.argv[1]
r_res, w_res = os.pipe()
r_go, w_go = os.pipe()
kids = []
for _ in range(300):
    pid = os.fork()
    if pid == 0:
        os.close(r_res)
        os.close(w_go)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(20)
        ok = b"0"
        try:
            s.connect(path)
            s.sendall(b'{"op": "ping", "id": 1}\\n')
            ok = b"1" if s.recv(4096).startswith(b"{") else b"0"
        except OSError:
            pass
        os.write(w_res, ok)
        os.read(r_go, 1)
        os._exit(0)
    kids.append(pid)
os.close(w_res)
os.close(r_go)
served = sum(int(os.read(r_res, 1)) for _ in kids)
print(served, flush=True)
sys.stdin.readline()
os.close(w_go)
for pid in kids:
    os.waitpid(pid, 0)
"""


@pytest.mark.timeout(120)
def test_forked_children_of_one_worker_do_not_lock_others_out_of_the_control_socket():
    """300 forked children of one worker: at most 64 served; another worker's ping is answered."""
    from elasticd.control.client import ControlClient
    from elasticd.control.messages import Ping
    from elasticd.control.server import ControlChannel

    chan = ControlChannel().start()
    proc = subprocess.Popen([sys.executable, "-c", HOARD, chan.socket_path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        served = int(proc.stdout.readline())  # every child has connected and been answered or not
        reply = ControlClient(chan.socket_path, timeout_s=5).request(Ping())
        assert type(reply).__name__ == "Pong", reply
        assert 0 < served <= 64
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session and group
            proc.wait(timeout=30)
        chan.close()
