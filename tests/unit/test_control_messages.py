"""The control channel's messages: strict parsing, bounds, and the server's bounded tables."""

from __future__ import annotations

import json

import pytest

from elasticd.checkpoint.api import CommitOutcome
from elasticd.control import (
    CheckpointIo,
    CheckpointIoKind,
    CommitReply,
    CommitRequest,
    ControlChannel,
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
from elasticd.control.messages import MAX_LINE_BYTES, MAX_STR
from elasticd.records import CheckpointPointer


def _line(**obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


@pytest.mark.parametrize("msg", [
    StepReport(local_rank=1, rank=5, step=10, epoch=2, samples=640),
    StepReport(local_rank=0, rank=0, step=3, loss=0.25),
    StepReport(local_rank=0, rank=0, step=3, save_every=24, save_interval_s=12.0,
               cadence="12.0 s: Young–Daly"),
    CommitRequest(step=10, manifest_url="file:///c/j/step-10/x/manifest.json", world_size=4, round=3, id=7),
    LatestRequest(id=2),
    Ping(id=9),
    CheckpointIo(kind=CheckpointIoKind.SAVE, step=40, seconds=0.25, nbytes=38597),
])
def test_requests_round_trip(msg):
    """Every request type serialises to one line and parses back to an equal value."""
    line = serialise(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert parse_request(line) == msg


@pytest.mark.parametrize("msg", [
    CommitReply(CommitOutcome.UNKNOWN, "etcd did not answer", id=3),
    CommitReply(CommitOutcome.REFUSED, "fenced", id=4),
    LatestReply(ok=True, pointer=CheckpointPointer(step=5, round=1, manifest_url="u",
                                                  committed_at=1.0, world_size=2), id=5),
    LatestReply(ok=False, reason="etcd down", id=6),
    Pong(id=1),
    ErrorReply("bad", id=None),
])
def test_replies_round_trip(msg):
    """Every reply type serialises to one line and parses back to an equal value."""
    assert parse_reply(serialise(msg)) == msg


@pytest.mark.parametrize("obj, fragment", [
    ({"op": "commit", "step": True, "manifest_url": "u", "world_size": 1, "round": 0}, "commit message.step: expected int, got a boolean"),
    ({"op": "commit", "step": 1.5, "manifest_url": "u", "world_size": 1, "round": 0}, "commit message.step: expected int, got a number"),
    ({"op": "commit", "step": "1", "manifest_url": "u", "world_size": 1, "round": 0}, "commit message.step: expected int, got a string"),
    ({"op": "commit", "step": -1, "manifest_url": "u", "world_size": 1, "round": 0}, "commit message.step: -1 is outside [0,"),
    ({"op": "commit", "step": 2**70, "manifest_url": "u", "world_size": 1, "round": 0}, "is outside"),
    ({"op": "commit", "step": 1, "manifest_url": "u" * (MAX_STR + 1), "world_size": 1, "round": 0}, "characters long"),
    ({"op": "commit", "step": 1, "manifest_url": 5, "world_size": 1, "round": 0}, "commit message.manifest_url: expected str, got a number"),
    ({"op": "commit", "step": 1, "manifest_url": "u", "world_size": 0, "round": 0}, "commit message.world_size: 0 is outside [1,"),
    ({"op": "commit", "step": 1, "manifest_url": "u", "world_size": 1}, "commit message: field 'round' is missing"),
    ({"op": "progress", "local_rank": 10**9, "rank": 0, "step": 1}, "progress message.local_rank: 1000000000 is outside"),
    ({"op": "progress", "local_rank": 0, "rank": -3, "step": 1}, "progress message.rank: -3 is outside"),
    ({"op": "progress", "local_rank": 0, "rank": 0, "step": 1, "loss": "0.5"}, "progress message.loss: expected float, got a string"),
    ({"op": "progress", "local_rank": 0, "rank": 0, "step": 1, "loss": True}, "progress message.loss: expected float, got a boolean"),
    ({"op": "format_disk"}, "unknown op 'format_disk'"),
    ({"step": 1}, "no 'op' field"),
])
def test_invalid_requests_are_rejected_naming_the_field(obj, fragment):
    """Wrong types (bools, floats, strings for ints), out-of-bound values and unknown ops are
    rejected with a message naming the field or op."""
    with pytest.raises(MessageError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        parse_request(_line(**obj))


def test_a_non_finite_loss_is_dropped_not_plotted():
    """A diverged step's NaN or inf loss arrives as no loss (the step still counts)."""
    for raw in (b'NaN', b'Infinity'):
        line = b'{"op": "progress", "local_rank": 0, "rank": 0, "step": 4, "loss": ' + raw + b'}\n'
        msg = parse_request(line)
        assert isinstance(msg, StepReport) and (msg.step, msg.loss) == (4, None)


def test_non_objects_and_overlong_lines_are_rejected():
    """A JSON array, invalid JSON and a line over 64 KiB are rejected before any field is read."""
    for raw in (b"[1,2]\n", b"{nope\n", b"\xff\xfe\n"):
        with pytest.raises(MessageError):
            parse_request(raw)
    with pytest.raises(MessageError, match="exceeds"):
        parse_request(b'{"op":"ping","pad":"' + b"x" * MAX_LINE_BYTES + b'"}\n')


def test_unknown_outcome_in_a_reply_is_rejected():
    """A commit reply must carry one of the three outcomes."""
    with pytest.raises(MessageError, match="outcome"):
        parse_reply(_line(op="commit_reply", outcome="maybe", reason="", id=1))


def test_server_rejects_unknown_op_with_a_reply_naming_it():
    """The dispatcher answers an unknown op with an error that names it and echoes the id."""
    chan = ControlChannel()
    try:
        reply = chan.dispatch(_line(op="reboot", id=4))
        assert isinstance(reply, ErrorReply) and "reboot" in reply.reason and reply.id == 4
        assert chan.dispatch(_line(op="progress", local_rank="x")) is None  # never answered
    finally:
        chan.close()


def test_progress_table_is_bounded_by_local_ranks():
    """A worker reporting rank 10**9, or 10000 reports from 1000 distinct local ranks, does
    not grow the agent's table (bound: 2)."""
    chan = ControlChannel(max_local_ranks=2)
    try:
        assert chan.dispatch(_line(op="progress", local_rank=10**9, rank=0, step=1)) is None
        for r in range(10_000):
            chan.dispatch(serialise(StepReport(local_rank=r % 1000, rank=r, step=r)))
        assert set(chan.progress.snapshot()) <= {0, 1}
        assert chan.rejected >= 10_000 - 20
    finally:
        chan.close()


def test_commit_handler_error_is_unknown_never_refused():
    """An exception in the agent's commit handler answers UNKNOWN (the worker keeps its upload)."""
    def boom(req: CommitRequest) -> tuple[CommitOutcome, str]:
        raise RuntimeError("etcdserver: mvcc: database space exceeded")

    chan = ControlChannel(on_commit=boom)
    try:
        reply = chan.dispatch(serialise(CommitRequest(step=1, manifest_url="u", world_size=1, round=0, id=3)))
        assert isinstance(reply, CommitReply)
        assert reply.outcome is CommitOutcome.UNKNOWN and reply.id == 3
    finally:
        chan.close()


def test_runtime_dir_is_private():
    """The runtime directory is mode 0700."""
    chan = ControlChannel()
    try:
        assert chan.dir.stat().st_mode & 0o777 == 0o700
    finally:
        chan.close()


@pytest.mark.parametrize("obj, fragment", [
    ({"op": "checkpoint_io", "kind": "delete", "step": 1, "seconds": 1.0, "nbytes": 1}, "checkpoint_io message.kind: 'delete' is not one of 'save', 'load'"),
    ({"op": "checkpoint_io", "kind": "save", "step": 1, "seconds": -1.0, "nbytes": 1}, "checkpoint_io message.seconds: -1.0 is outside"),
    ({"op": "checkpoint_io", "kind": "save", "step": 1, "seconds": True, "nbytes": 1}, "checkpoint_io message.seconds: expected float, got a boolean"),
    ({"op": "checkpoint_io", "kind": "load", "step": 1, "seconds": 1.0, "nbytes": -5}, "checkpoint_io message.nbytes: -5 is outside"),
])
def test_invalid_checkpoint_reports_are_rejected(obj, fragment):
    """A checkpoint report with an unknown kind, a negative or non-number duration, or negative bytes is refused."""
    with pytest.raises(MessageError, match=fragment):
        parse_request(_line(**obj))


def test_checkpoint_reports_reach_the_handler_without_a_reply(tmp_path):
    """A valid checkpoint_io report is handed to on_checkpoint_io; neither it nor an invalid one is answered."""
    seen: list[CheckpointIo] = []
    ch = ControlChannel(base_dir=str(tmp_path), on_checkpoint_io=seen.append)
    try:
        report = CheckpointIo(kind=CheckpointIoKind.LOAD, step=9, seconds=0.03, nbytes=100)
        assert ch.dispatch(serialise(report)) is None
        assert ch.dispatch(_line(op="checkpoint_io", kind="x")) is None
        assert seen == [report] and ch.rejected == 1
    finally:
        ch.close()



@pytest.mark.timeout(30)
def test_a_worker_gone_with_a_reply_unread_ends_its_connection_without_a_traceback(tmp_path, capsys):
    """A worker killed after asking (its reply unread, a line half sent) resets the socket: the
    agent's next read gets ECONNRESET, which ends that connection quietly (no socketserver
    traceback on the agent's stderr), and the channel keeps answering others."""
    import socket

    ch = ControlChannel(base_dir=str(tmp_path)).start()
    try:
        for _ in range(3):
            gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            gone.settimeout(10)
            gone.connect(ch.socket_path)
            gone.sendall(serialise(Ping(id=1)))
            assert gone.recv(1, socket.MSG_PEEK)  # the reply arrived; it stays unread
            gone.sendall(serialise(Ping(id=2))[:5])
            gone.close()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as alive:
            alive.settimeout(10)
            alive.connect(ch.socket_path)
            alive.sendall(serialise(Ping(id=7)))
            assert b"pong" in alive.makefile("rb").readline()
    finally:
        ch.close()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err
