"""Preemption watchers against fake AWS/GCP/Azure metadata servers on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from structlog.testing import capture_logs

from elasticd.agent.preemption import (
    AwsSpotSource,
    AzureScheduledEventsSource,
    GcpPreemptionSource,
    PreemptionNotice,
    PreemptionWatcher,
    detect_provider,
    make_watcher,
)

pytestmark = pytest.mark.timeout(60)
POLL_S = 0.05
BOUND_S = 5.0  # generous bound for a loaded 2-core CI machine; typical is < 0.2 s


class FakeMetadata:
    """A metadata server speaking just enough of one cloud's API (``cloud``)."""

    def __init__(self, cloud: str) -> None:
        self.cloud = cloud
        self.cond = threading.Condition()
        self.hits: Counter[str] = Counter()
        self.aws_token = "token-1"
        self.aws_action: dict | None = None
        self.gcp_preempted = False
        self.gcp_version = 1
        self.gcp_waiting = 0
        self.azure_name = "vm-self"
        self.azure_events: list[dict] = []
        self.closing = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> FakeMetadata:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def update(self, change: Callable[[FakeMetadata], None]) -> None:
        with self.cond:
            change(self)
            self.gcp_version += 1
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = BOUND_S) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout_s), f"timed out; hits={self.hits}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:  # noqa: N802 - http.server naming
                path = urlsplit(self.path).path
                with fake.cond:
                    fake.hits["PUT " + path] += 1
                    fake.cond.notify_all()
                    if fake.cloud != "aws" or path != "/latest/api/token":
                        return self._send(404)
                    if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                        return self._send(400)
                    return self._send(200, fake.aws_token.encode())

            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                with fake.cond:
                    fake.hits["GET " + parts.path] += 1
                    fake.cond.notify_all()
                    if fake.cloud == "aws":
                        return self._aws(parts.path)
                    if fake.cloud == "gcp":
                        return self._gcp(parts.path, query)
                    return self._azure(parts.path)

            def _aws(self, path: str) -> None:
                if path != "/latest/meta-data/spot/instance-action":
                    return self._send(404)
                if self.headers.get("X-aws-ec2-metadata-token") != fake.aws_token:
                    return self._send(401)
                if fake.aws_action is None:
                    return self._send(404, b"Not Found")
                return self._send(200, json.dumps(fake.aws_action).encode())

            def _gcp(self, path: str, query: dict) -> None:
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403)
                flavor = {"Metadata-Flavor": "Google"}
                if path == "/computeMetadata/v1/instance/id":
                    return self._send(200, b"1234", flavor)
                if path != "/computeMetadata/v1/instance/preempted":
                    return self._send(404, headers=flavor)
                if query.get("wait_for_change") == ["true"]:
                    etag = query.get("last_etag", [""])[0]
                    timeout_s = float(query.get("timeout_sec", ["10"])[0])
                    fake.gcp_waiting += 1
                    fake.cond.notify_all()
                    fake.cond.wait_for(
                        lambda: fake.closing or f"v{fake.gcp_version}" != etag, timeout_s
                    )
                    fake.gcp_waiting -= 1
                body = b"TRUE" if fake.gcp_preempted else b"FALSE"
                return self._send(200, body, {**flavor, "ETag": f"v{fake.gcp_version}"})

            def _azure(self, path: str) -> None:
                if self.headers.get("Metadata") != "true":
                    return self._send(400)
                if path == "/metadata/instance":
                    return self._send(200, b'{"compute": {}}')
                if path == "/metadata/instance/compute/name":
                    return self._send(200, fake.azure_name.encode())
                if path != "/metadata/scheduledevents":
                    return self._send(404)
                doc = {"DocumentIncarnation": fake.gcp_version, "Events": fake.azure_events}
                return self._send(200, json.dumps(doc).encode())

        return Handler


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Notices:
    """Collects on_notice calls and lets a test wait for the first."""

    def __init__(self) -> None:
        self.got: list[tuple[float, PreemptionNotice]] = []
        self.event = threading.Event()

    def __call__(self, notice: PreemptionNotice) -> None:
        self.got.append((time.monotonic(), notice))
        self.event.set()

    def first(self, timeout_s: float = BOUND_S) -> tuple[float, PreemptionNotice]:
        assert self.event.wait(timeout_s), "no preemption notice within the bound"
        return self.got[0]


def watch(source, notices: Notices, interval_s: float = POLL_S) -> PreemptionWatcher:
    watcher = PreemptionWatcher(source, interval_s)
    watcher.start(notices)
    return watcher


SOURCES = {
    "aws": lambda url: AwsSpotSource(url, timeout_s=1.0),
    "gcp": lambda url: GcpPreemptionSource(url, timeout_s=1.0),
    "azure": lambda url: AzureScheduledEventsSource(url, timeout_s=1.0),
}
POLL_PATH = {
    "aws": "GET /latest/meta-data/spot/instance-action",
    "gcp": "GET /computeMetadata/v1/instance/preempted",
    "azure": "GET /metadata/scheduledevents",
}


def publish_notice(fake: FakeMetadata) -> None:
    if fake.cloud == "aws":
        fake.aws_action = {"action": "terminate", "time": "2030-01-01T00:02:00Z"}
    elif fake.cloud == "gcp":
        fake.gcp_preempted = True
    else:
        fake.azure_events = [
            {"EventId": "e1", "EventType": "Preempt", "ResourceType": "VirtualMachine",
             "Resources": ["vm-self"], "EventStatus": "Scheduled",
             "NotBefore": "Tue, 01 Jan 2030 00:00:30 GMT"},
        ]


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_notice_is_reported_once_within_bound(cloud):
    """A notice published by the metadata service reaches on_notice once, within the bound."""
    notices = Notices()
    with FakeMetadata(cloud) as fake:
        watcher = watch(SOURCES[cloud](fake.url), notices)
        try:
            fake.wait_for(lambda: fake.hits[POLL_PATH[cloud]] >= 2)
            published = time.monotonic()
            fake.update(publish_notice)
            received, notice = notices.first()
            polls_at_notice = fake.hits[POLL_PATH[cloud]]
            watcher._thread.join(BOUND_S)  # the watcher ends after reporting
            assert not watcher.running
        finally:
            watcher.stop()
    assert notice.provider == cloud
    assert received - published < BOUND_S
    assert len(notices.got) == 1 and watcher.notice == notice
    assert fake.hits[POLL_PATH[cloud]] == polls_at_notice  # no polling after the notice
    if cloud == "aws":
        assert notice.deadline == pytest.approx(1893456120.0)
        assert fake.hits["PUT /latest/api/token"] == 1  # the IMDSv2 token is reused
    elif cloud == "azure":
        assert notice.deadline == pytest.approx(1893456030.0)
    else:
        assert notice.seconds_left() == pytest.approx(30, abs=BOUND_S)


def test_the_drain_starts_when_the_lead_is_left():
    """With drain_lead_s, a notice 120 s out is reported when that much is left (here 2 s
    after it), not at once: the node trains on through the part of the notice it need not
    spend drained."""
    notices = Notices()
    with FakeMetadata("aws") as fake:
        watcher = PreemptionWatcher(SOURCES["aws"](fake.url), POLL_S, drain_lead_s=118.0)
        watcher.start(notices)
        try:
            fake.wait_for(lambda: fake.hits[POLL_PATH["aws"]] >= 1)
            deadline = time.time() + 120.0
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline))
            published = time.monotonic()
            fake.update(lambda f: setattr(f, "aws_action", {"action": "terminate", "time": when}))
            received, notice = notices.first(BOUND_S + 3.0)
        finally:
            watcher.stop()
    # The deadline has whole seconds: it is 119-120 s out, so the wait is 1-2 s (+ a poll).
    assert 0.9 < received - published < 2.0 + BOUND_S, received - published
    assert notice.seconds_left() == pytest.approx(118.0, abs=BOUND_S)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_no_notice_means_no_callback(cloud):
    """While the service reports nothing, polls succeed and on_notice is never called."""
    notices = Notices()
    with FakeMetadata(cloud) as fake:
        watcher = watch(SOURCES[cloud](fake.url), notices)
        try:
            fake.wait_for(lambda: fake.hits[POLL_PATH[cloud]] >= 5)
            assert watcher.running
        finally:
            watcher.stop()
    assert not watcher.running
    assert notices.got == [] and watcher.notice is None and watcher.last_error is None


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_unreachable_service_is_survived_and_logged_once(cloud):
    """With the metadata service down the watcher keeps polling, logs the error once."""
    notices = Notices()
    with capture_logs() as logs:
        watcher = watch(SOURCES[cloud](closed_port_url()), notices)
        try:
            deadline = time.monotonic() + BOUND_S
            while watcher.polls < 4:
                assert time.monotonic() < deadline, "watcher stopped polling"
                watcher._stop.wait(POLL_S)
            assert watcher.running and watcher.last_error
        finally:
            watcher.stop()
    failures = [e for e in logs if e["event"] == "preemption_poll_failed"]
    assert len(failures) == 1, failures
    assert notices.got == []


def test_aws_token_is_renewed_after_401():
    """When IMDSv2 rejects the cached token, the watcher fetches a new one and goes on."""
    notices = Notices()
    with FakeMetadata("aws") as fake:
        watcher = watch(SOURCES["aws"](fake.url), notices)
        try:
            fake.wait_for(lambda: fake.hits[POLL_PATH["aws"]] >= 2)
            fake.update(lambda f: setattr(f, "aws_token", "token-2"))
            fake.wait_for(lambda: fake.hits["PUT /latest/api/token"] >= 2)
            fake.update(publish_notice)
            notices.first()
        finally:
            watcher.stop()
    assert watcher.last_error is None


def test_azure_ignores_events_for_other_vms():
    """A Preempt event naming another VM of the scale set is not this node's notice."""
    notices = Notices()
    with FakeMetadata("azure") as fake:
        fake.azure_events = [{"EventId": "x", "EventType": "Preempt", "Resources": ["vm-other"],
                              "NotBefore": ""}]
        watcher = watch(SOURCES["azure"](fake.url), notices)
        try:
            fake.wait_for(lambda: fake.hits[POLL_PATH["azure"]] >= 3)
            assert notices.got == []
            fake.update(publish_notice)
            _, notice = notices.first()
        finally:
            watcher.stop()
    assert "e1" in notice.detail
    assert fake.hits["GET /metadata/instance/compute/name"] == 1


def test_gcp_wait_for_change_reports_without_polling_delay():
    """With wait_for_change the notice arrives while a long poll is pending, not a poll later."""
    notices = Notices()
    with FakeMetadata("gcp") as fake:
        source = GcpPreemptionSource(fake.url, timeout_s=1.0, wait_for_change=True, wait_s=20)
        watcher = watch(source, notices, interval_s=30.0)  # polling alone would be far too slow
        try:
            fake.wait_for(lambda: fake.gcp_waiting == 1)
            published = time.monotonic()
            fake.update(publish_notice)
            received, notice = notices.first()
        finally:
            watcher.stop()
    assert received - published < BOUND_S
    assert notice.provider == "gcp"


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_detect_provider_finds_the_cloud(cloud):
    """Auto-detection names the cloud whose metadata service answers, None off-cloud."""
    down = closed_port_url()
    with FakeMetadata(cloud) as fake:
        urls = {"aws": down, "gcp": down, "azure": down, cloud: fake.url}
        assert detect_provider(urls, timeout_s=1.0) == cloud
    assert detect_provider({"aws": down, "gcp": down, "azure": down}, timeout_s=1.0) is None


def test_auto_provider_off_cloud_ends_quietly():
    """provider = "auto" where no metadata service answers: the watcher gives up, no notice."""
    notices = Notices()
    watcher = make_watcher("auto", base_url=closed_port_url(), poll_interval_s=POLL_S)
    assert watcher is not None
    with capture_logs() as logs:
        watcher.start(notices)
        watcher._thread.join(BOUND_S)
    assert not watcher.running and notices.got == []
    assert any(e["event"] == "preemption_provider_not_detected" for e in logs)


def test_auto_provider_detects_and_reports_a_notice():
    """provider = "auto" with a base_url override detects the fake cloud and watches it."""
    notices = Notices()
    with FakeMetadata("gcp") as fake:
        watcher = make_watcher("auto", base_url=fake.url, poll_interval_s=POLL_S)
        assert watcher is not None
        watcher.start(notices)
        try:
            fake.wait_for(lambda: fake.hits[POLL_PATH["gcp"]] >= 1)
            fake.update(publish_notice)
            _, notice = notices.first()
        finally:
            watcher.stop()
    assert notice.provider == "gcp"
