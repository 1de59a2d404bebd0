"""Cloud instance metadata: preemption notices from AWS, GCP and Azure.

Pure functions parse one metadata response into a :class:`PreemptionNotice` or None
(unit-tested without a network); one small source class per cloud does the HTTP with
the stdlib only (``urllib``, short timeouts, proxies bypassed). The thread that polls
a source is :class:`elasticd.agent.preemption.PreemptionWatcher`.

Endpoints (base URLs are configurable, ``[preemption] base_url``):

- AWS (IMDSv2): ``PUT /latest/api/token`` (header ``X-aws-ec2-metadata-token-ttl-seconds``),
  then ``GET /latest/meta-data/spot/instance-action`` (header ``X-aws-ec2-metadata-token``);
  404 = nothing scheduled, JSON ``{"action": "terminate", "time": ...}`` = notice.
- GCP: ``GET /computeMetadata/v1/instance/preempted`` (header ``Metadata-Flavor: Google``);
  ``TRUE`` = notice, optionally as a long poll (``?wait_for_change=true``).
- Azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` (header ``Metadata: true``);
  an event of type ``Preempt`` naming this VM = notice, ``NotBefore`` = deadline.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from email.message import Message
from email.utils import parsedate_to_datetime
from typing import Protocol

import structlog

from elasticd import boundedjson

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 1 << 20  # a notice is well under 1 KB; the metadata service is not ours

DEFAULT_BASE_URLS: Mapping[str, str] = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
# GCP gives no deadline in the metadata, only the documented 30 s between the
# preemption notice and the hard stop.
GCP_NOTICE_S = 30.0
AWS_STOP_ACTIONS = ("terminate", "stop", "hibernate")
# "Terminate" only appears where the operator opted in to termination notifications
# (scale-set scale-in); like "Preempt" it means the VM is about to go away.
AZURE_STOP_EVENTS = ("Preempt", "Terminate")
AZURE_API_VERSION = "2020-07-01"


class MetadataError(Exception):
    """The metadata service answered something we cannot use (or did not answer)."""


@dataclass(frozen=True)
class PreemptionNotice:
    """This machine is about to be taken away.

    Attributes:
        provider: ``"aws"``, ``"gcp"`` or ``"azure"``.
        deadline: Unix time when the machine stops (None when the cloud does not say).
        detail: human-readable description for logs and events.
    """

    provider: str
    deadline: float | None
    detail: str

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until ``deadline`` (never negative), or None without a deadline."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - (time.time() if now is None else now))


# --- pure parsing ------------------------------------------------------------------


def parse_aws_instance_action(status: int, body: bytes) -> PreemptionNotice | None:
    """Parse ``GET /latest/meta-data/spot/instance-action``.

    Returns:
        None for 404 (no action scheduled), a notice for an ``action`` of terminate,
        stop or hibernate; ``time`` (RFC 3339 UTC) becomes the deadline.

    Raises:
        MetadataError: any other status, or a body that is not the documented JSON.
    """
    if status == 404:
        return None
    if status != 200:
        raise MetadataError(f"AWS spot/instance-action returned HTTP {status}")
    try:
        doc = boundedjson.loads_object(body, what="AWS spot/instance-action", max_bytes=MAX_BODY_BYTES)
        action = doc["action"]
    except (ValueError, KeyError, TypeError) as exc:
        raise MetadataError(f"AWS spot/instance-action body is not JSON with 'action': {body[:200]!r}") from exc
    if action not in AWS_STOP_ACTIONS:
        return None
    when = doc.get("time")
    deadline = _parse_rfc3339(when) if isinstance(when, str) else None
    return PreemptionNotice("aws", deadline, f"spot instance-action {action} at {when}")


def parse_gcp_preempted(status: int, body: bytes, now: float) -> PreemptionNotice | None:
    """Parse ``GET /computeMetadata/v1/instance/preempted``.

    Args:
        now: Unix time the answer was received; the deadline is ``now + 30 s``.

    Returns:
        A notice for ``TRUE``, None for ``FALSE``.

    Raises:
        MetadataError: any other status or body.
    """
    if status != 200:
        raise MetadataError(f"GCP instance/preempted returned HTTP {status}")
    text = body.decode("ascii", "replace").strip().upper()
    if text == "FALSE":
        return None
    if text == "TRUE":
        return PreemptionNotice(
            "gcp", now + GCP_NOTICE_S, "instance/preempted is TRUE (about 30 s left)"
        )
    raise MetadataError(f"GCP instance/preempted body is neither TRUE nor FALSE: {body[:50]!r}")


def parse_azure_scheduled_events(
    status: int, body: bytes, resource_name: str | None = None
) -> PreemptionNotice | None:
    """Parse ``GET /metadata/scheduledevents``.

    Args:
        resource_name: this VM's name. Events list the VMs they affect and may be
            about a neighbour in the same scale set; with a name, only events naming
            this VM count. None counts every event (draining needlessly costs a
            restart; missing an eviction costs the steps since the last checkpoint).

    Returns:
        A notice for the first ``Preempt`` (or ``Terminate``) event affecting this VM;
        its ``NotBefore`` (RFC 1123) becomes the deadline. None otherwise.

    Raises:
        MetadataError: a status other than 200 or a body that is not the documented JSON.
    """
    if status != 200:
        raise MetadataError(f"Azure scheduledevents returned HTTP {status}")
    try:
        events = boundedjson.loads_object(body, what="Azure scheduledevents",
                                          max_bytes=MAX_BODY_BYTES)["Events"]
        if not isinstance(events, list):
            raise TypeError("Events is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise MetadataError(f"Azure scheduledevents body is not JSON with 'Events': {body[:200]!r}") from exc
    for event in events:
        if not isinstance(event, dict) or event.get("EventType") not in AZURE_STOP_EVENTS:
            continue
        resources = event.get("Resources") or []
        if resource_name is not None and resources and resource_name not in resources:
            continue
        not_before = event.get("NotBefore") or ""
        deadline = _parse_rfc1123(not_before) if not_before else None
        return PreemptionNotice(
            "azure",
            deadline,
            f"scheduled event {event.get('EventType')} {event.get('EventId', '?')} "
            f"not before {not_before or 'now'}",
        )
    return None


def _parse_rfc3339(text: str) -> float | None:
    try:
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def _parse_rfc1123(text: str) -> float | None:
    try:
        return parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError):
        return None


# --- HTTP ------------------------------------------------------------------------

# Metadata services are link-local: an http_proxy from the environment must never
# see these requests (it could not reach them, and AWS tokens must not leave the box).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _request(
    method: str, url: str, headers: Mapping[str, str], timeout_s: float
) -> tuple[int, Message, bytes]:
    """One HTTP request; HTTP error statuses are returned, not raised.

    Raises:
        OSError: no answer (connection refused, timeout, DNS failure).
    """
    data = b"" if method == "PUT" else None
    request = urllib.request.Request(url, data=data, headers=dict(headers), method=method)
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            return response.status, response.headers, response.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers, exc.read(MAX_BODY_BYTES + 1)


# --- sources (one per cloud) -----------------------------------------------------


class MetadataSource(Protocol):
    """One cloud's notice check. ``poll`` may raise (OSError, MetadataError)."""

    provider: str

    def poll(self) -> PreemptionNotice | None: ...


class AwsSpotSource:
    """AWS EC2 spot interruption notices through IMDSv2 (session token, then GET)."""

    provider = "aws"

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout_s: float = 2.0,
        token_ttl_s: int = 21600,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_url = (base_url or DEFAULT_BASE_URLS["aws"]).rstrip("/")
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self._clock = clock
        self._token: str | None = None
        self._token_expiry = 0.0

    def _session_token(self) -> str:
        if self._token is None or self._clock() >= self._token_expiry:
            status, _, body = _request(
                "PUT",
                f"{self.base_url}/latest/api/token",
                {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
                self.timeout_s,
            )
            if status != 200 or not body:
                raise MetadataError(f"AWS IMDSv2 token request returned HTTP {status}")
            self._token = body.decode("ascii", "replace").strip()
            # Renew a minute early so a poll never carries a token that expires in flight.
            self._token_expiry = self._clock() + max(1.0, self.token_ttl_s - 60)
        return self._token

    def poll(self) -> PreemptionNotice | None:
        """Return the pending spot interruption, if any."""
        for _ in range(2):
            status, _, body = _request(
                "GET",
                f"{self.base_url}/latest/meta-data/spot/instance-action",
                {"X-aws-ec2-metadata-token": self._session_token()},
                self.timeout_s,
            )
            if status != 401:
                return parse_aws_instance_action(status, body)
            self._token = None  # expired or rotated: fetch a new one and ask again
        raise MetadataError("AWS IMDSv2 refused a fresh token (HTTP 401)")


class GcpPreemptionSource:
    """GCP preemptible/spot VMs: ``instance/preempted`` flips to TRUE ~30 s before the stop.

    With ``wait_for_change`` each request is a long poll that returns as soon as the
    value changes (at most ``wait_s`` later), so the notice arrives without polling delay.
    """

    provider = "gcp"

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout_s: float = 2.0,
        wait_for_change: bool = False,
        wait_s: int = 10,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.base_url = (base_url or DEFAULT_BASE_URLS["gcp"]).rstrip("/")
        self.timeout_s = timeout_s
        self.wait_for_change = wait_for_change
        self.long_poll = wait_for_change  # the watcher need not sleep between polls
        self.wait_s = wait_s
        self._clock = clock
        self._etag: str | None = None

    def poll(self) -> PreemptionNotice | None:
        """Return the notice once the instance is marked preempted."""
        url = f"{self.base_url}/computeMetadata/v1/instance/preempted"
        timeout_s = self.timeout_s
        if self.wait_for_change and self._etag is not None:
            url += f"?wait_for_change=true&timeout_sec={self.wait_s}&last_etag={self._etag}"
            timeout_s += self.wait_s
        status, headers, body = _request("GET", url, {"Metadata-Flavor": "Google"}, timeout_s)
        if status == 200:
            self._etag = headers.get("ETag") or self._etag
        return parse_gcp_preempted(status, body, self._clock())


class AzureScheduledEventsSource:
    """Azure Spot evictions through Scheduled Events (``EventType: Preempt``)."""

    provider = "azure"

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout_s: float = 2.0,
        resource_name: str | None = None,
    ) -> None:
        self.base_url = (base_url or DEFAULT_BASE_URLS["azure"]).rstrip("/")
        self.timeout_s = timeout_s
        self.resource_name = resource_name
        self._name_looked_up = resource_name is not None

    def _lookup_name(self) -> None:
        # Once: this VM's name, to ignore events about neighbours in the scale set.
        self._name_looked_up = True
        try:
            status, _, body = _request(
                "GET",
                f"{self.base_url}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                {"Metadata": "true"},
                self.timeout_s,
            )
        except OSError:
            return
        name = body.decode("utf-8", "replace").strip()
        if status == 200 and name:
            self.resource_name = name

    def poll(self) -> PreemptionNotice | None:
        """Return the notice of a pending eviction of this VM, if any."""
        if not self._name_looked_up:
            self._lookup_name()
        status, _, body = _request(
            "GET",
            f"{self.base_url}/metadata/scheduledevents?api-version={AZURE_API_VERSION}",
            {"Metadata": "true"},
            self.timeout_s,
        )
        return parse_azure_scheduled_events(status, body, self.resource_name)


def detect_provider(
    base_urls: Mapping[str, str] | None = None, *, timeout_s: float = 1.0
) -> str | None:
    """Find out which cloud this machine runs in, by asking each metadata service.

    GCP is asked first (its DNS name fails fast elsewhere); AWS and Azure share an
    address and are told apart by their APIs.

    Returns:
        ``"gcp"``, ``"azure"``, ``"aws"``, or None when no metadata service answered.
    """
    urls = {**DEFAULT_BASE_URLS, **(base_urls or {})}
    probes: list[tuple[str, str, str, dict[str, str]]] = [
        ("gcp", "GET", "/computeMetadata/v1/instance/id", {"Metadata-Flavor": "Google"}),
        ("azure", "GET", "/metadata/instance?api-version=2021-02-01", {"Metadata": "true"}),
        ("aws", "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}),
    ]
    for provider, method, path, headers in probes:
        try:
            status, answer_headers, _ = _request(
                method, urls[provider].rstrip("/") + path, headers, timeout_s
            )
        except OSError:
            continue
        if status != 200:
            continue
        if provider == "gcp" and answer_headers.get("Metadata-Flavor") != "Google":
            continue
        return provider
    return None


class AutoDetectSource:
    """Detects the cloud on the first polls, then behaves as that cloud's source.

    Raises :class:`NoProviderError` from ``poll`` once ``attempts`` detections found
    nothing, which ends the watcher: off-cloud there is nothing to watch.
    """

    provider = "auto"

    def __init__(
        self, base_url: str | None = None, *, timeout_s: float = 1.0, attempts: int = 3
    ) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._source: MetadataSource | None = None
        self._tries = 0

    def poll(self) -> PreemptionNotice | None:
        """Detect the provider if not known yet, then poll it."""
        if self._source is None:
            self._tries += 1
            urls = dict.fromkeys(DEFAULT_BASE_URLS, self.base_url) if self.base_url else None
            provider = detect_provider(urls, timeout_s=self.timeout_s)
            if provider is None:
                if self._tries >= self.attempts:
                    raise NoProviderError(f"no cloud metadata service answered in {self._tries} tries")
                return None
            log.info("preemption_provider_detected", provider=provider)
            self._source = make_source(provider, self.base_url, timeout_s=max(self.timeout_s, 2.0))
            self.provider = provider
        return self._source.poll()


class NoProviderError(Exception):
    """``provider = "auto"`` found no cloud metadata service: nothing to watch."""


def make_source(provider: str, base_url: str | None = None, *, timeout_s: float = 2.0) -> MetadataSource:
    """Return the source for ``provider`` (``aws``, ``gcp``, ``azure`` or ``auto``)."""
    if provider == "aws":
        return AwsSpotSource(base_url, timeout_s=timeout_s)
    if provider == "gcp":
        return GcpPreemptionSource(base_url, timeout_s=timeout_s)
    if provider == "azure":
        return AzureScheduledEventsSource(base_url, timeout_s=timeout_s)
    if provider == "auto":
        return AutoDetectSource(base_url, timeout_s=min(timeout_s, 1.0))
    raise ValueError(f"unknown preemption provider {provider!r}")
