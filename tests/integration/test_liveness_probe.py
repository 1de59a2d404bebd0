"""The liveness probe's I/O against real sockets: what proves an agent gone, and what not."""

from __future__ import annotations

import socket

import pytest

from elasticd.rendezvous.liveness import LivenessListener, probe


def test_a_listening_agent_is_not_dead_and_a_closed_one_is():
    """Connected: proves nothing. Refused (the listener closed, as when its process dies):
    proven dead, by IP address and by host name alike."""
    listener = LivenessListener("127.0.0.1")
    try:
        assert probe("127.0.0.1", listener.port, 0.5) is False
        assert probe("localhost", listener.port, 0.5) is False
    finally:
        listener.close()
    assert probe("127.0.0.1", listener.port, 0.5) is True


def test_unresolvable_or_silent_proves_nothing():
    """A name that does not resolve, or a peer whose kernel completes the handshake but
    whose process never accepts (a frozen agent: a full backlog nobody reads), is not a
    dead node."""
    assert probe("no-such-host.invalid", 9, 0.2) is False
    frozen = socket.create_server(("127.0.0.1", 0), backlog=1)  # never accept()ed
    try:
        assert probe("127.0.0.1", frozen.getsockname()[1], 0.2) is False
    finally:
        frozen.close()


def test_listener_on_every_interface_and_on_ipv6():
    """With no local address the listener takes every interface; an IPv6 literal works."""
    anywhere = LivenessListener(None)
    try:
        assert probe("127.0.0.1", anywhere.port, 0.5) is False
    finally:
        anywhere.close()
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        v6 = LivenessListener("::1")
    except OSError as exc:
        pytest.skip(f"::1 cannot be bound here: {exc}")
    try:
        assert v6._sock.family == socket.AF_INET6
        assert probe("::1", v6.port, 0.5) is False
    finally:
        v6.close()
    assert probe("::1", v6.port, 0.5) is True


def test_an_address_this_host_does_not_hold_falls_back_to_every_interface():
    """A ``local_addr`` behind NAT (not on this host) must not stop the agent."""
    listener = LivenessListener("192.0.2.1")
    try:
        assert probe("127.0.0.1", listener.port, 0.5) is False
    finally:
        listener.close()
