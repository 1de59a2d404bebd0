"""free_port: below the kernel's ephemeral range, where outgoing connections do not land."""

from __future__ import annotations

import os
import socket

from elasticd.etcd import embedded


def test_free_ports_come_from_below_the_ephemeral_range_and_are_bindable():
    floor = embedded._ephemeral_floor()
    ports = [embedded.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    for port in ports:
        if floor - embedded._LOWEST_PORT >= 1000:
            assert embedded._LOWEST_PORT <= port < floor, (port, floor)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(embedded, "_ephemeral_floor", lambda: embedded._LOWEST_PORT + 10)
    port = embedded.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_port_held_by_a_listener_is_never_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken])
        monkeypatch.setattr(embedded._PORTS, "randrange", lambda lo, hi: next(picks, lo + 7))
        monkeypatch.setattr(embedded, "_ephemeral_floor", lambda: 60000)
        assert embedded.free_port() != taken
        assert embedded.listener_owned_by(os.getpid(), taken) is True
