"""The agent's Prometheus endpoint, scraped over HTTP on 127.0.0.1."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elasticd.errors import ConfigError
from elasticd.status.metrics import AgentMetrics


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.timeout(30)
def test_metrics_are_scraped_over_http():
    """A scrape returns the values the agent set, in the Prometheus text format."""
    m = AgentMetrics()
    m.set_round(3)
    m.set_world_size(8)
    m.restart("hang")
    m.observe_checkpoint_save(0.5, 2048)
    m.set_last_checkpoint_step(1200)
    server = m.serve(0, addr="127.0.0.1")
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.port > 0
        samples = scrape(server.url)
        assert samples[("elasticd_round", ())] == 3
        assert samples[("elasticd_world_size", ())] == 8
        assert samples[("elasticd_restarts_total", (("cause", "hang"),))] == 1
        assert samples[("elasticd_restarts_total", (("cause", "failure"),))] == 0
        assert samples[("elasticd_checkpoint_save_bytes_total", ())] == 2048
        assert samples[("elasticd_last_checkpoint_step", ())] == 1200
        m.set_round(4)
        assert scrape(server.url)[("elasticd_round", ())] == 4  # live values, not a snapshot
        assert not any(name.startswith("python_") for name, _ in samples)  # private registry
    finally:
        server.stop()


@pytest.mark.timeout(30)
def test_port_in_use_is_a_config_error():
    """Serving on a taken port fails with a ConfigError naming the address."""
    first = AgentMetrics().serve(0, addr="127.0.0.1")
    try:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{first.port}"):
            AgentMetrics().serve(first.port, addr="127.0.0.1")
    finally:
        first.stop()


@pytest.mark.timeout(60)
def test_idle_connections_hold_a_bounded_number_of_threads_for_a_bounded_time():
    """100 connections that send nothing: at most 16 serving threads at once (was one each,
    forever), each idle one closed by the server within its timeout, and a scrape then works."""
    import socket
    import threading
    import time

    from elasticd.status.metrics import METRICS_IDLE_TIMEOUT_S, METRICS_MAX_CONNECTIONS

    server = AgentMetrics().serve(0, addr="127.0.0.1")
    conns: list[socket.socket] = []
    try:
        before = threading.active_count()
        for _ in range(100):
            conns.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        deadline = time.monotonic() + 10
        while threading.active_count() < before + METRICS_MAX_CONNECTIONS \
                and time.monotonic() < deadline:
            time.sleep(0.02)  # the accept loop catches up
        assert threading.active_count() <= before + METRICS_MAX_CONNECTIONS
        # Every connection ends: refused at once over the cap, or closed when idle too long.
        deadline = time.monotonic() + METRICS_IDLE_TIMEOUT_S + 20
        for c in conns:
            c.settimeout(max(deadline - time.monotonic(), 0.1))
            assert c.recv(1) == b""
        scrape(server.url)
    finally:
        for c in conns:
            c.close()
        server.stop()
