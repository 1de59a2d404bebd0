"""Unit tests of preemption notice parsing and the watcher's error-state policy."""

from __future__ import annotations

import json

import pytest
from structlog.testing import capture_logs

from elasticd.agent.cloud_metadata import (
    MetadataError,
    parse_aws_instance_action,
    parse_azure_scheduled_events,
    parse_gcp_preempted,
)
from elasticd.agent.preemption import PreemptionNotice, PreemptionWatcher, make_watcher

# --- AWS ---------------------------------------------------------------------------


def test_aws_404_means_no_notice():
    """IMDS answers 404 on spot/instance-action while nothing is scheduled."""
    assert parse_aws_instance_action(404, b"Not Found") is None


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_aws_instance_action_is_a_notice_with_deadline(action):
    """An instance-action JSON is a notice whose deadline is its 'time' (UTC)."""
    body = json.dumps({"action": action, "time": "2017-09-18T08:22:00Z"}).encode()
    notice = parse_aws_instance_action(200, body)
    assert notice is not None and notice.provider == "aws"
    assert notice.deadline == 1505722920.0
    assert action in notice.detail


def test_aws_unparsable_time_gives_notice_without_deadline():
    """A notice is never dropped because its time field is odd."""
    notice = parse_aws_instance_action(200, b'{"action": "terminate", "time": "soon"}')
    assert notice is not None and notice.deadline is None


@pytest.mark.parametrize(
    ("status", "body"), [(500, b""), (200, b"<html>"), (200, b'{"time": "x"}'), (200, b"[]")]
)
def test_aws_unexpected_answers_raise(status, body):
    """Other statuses or bodies are errors (logged by the watcher), not silent 'no notice'."""
    with pytest.raises(MetadataError):
        parse_aws_instance_action(status, body)


# --- GCP ---------------------------------------------------------------------------


def test_gcp_true_is_a_notice_thirty_seconds_out():
    """preempted=TRUE is a notice with the documented 30 s deadline from receipt."""
    notice = parse_gcp_preempted(200, b"TRUE\n", now=1000.0)
    assert notice == PreemptionNotice("gcp", 1030.0, notice.detail)
    assert notice.seconds_left(now=1010.0) == 20.0
    assert notice.seconds_left(now=2000.0) == 0.0


def test_gcp_false_is_no_notice():
    """preempted=FALSE is no notice."""
    assert parse_gcp_preempted(200, b"FALSE", now=0.0) is None


@pytest.mark.parametrize(("status", "body"), [(403, b""), (200, b"MAYBE")])
def test_gcp_unexpected_answers_raise(status, body):
    """A 403 (missing Metadata-Flavor) or an odd body is an error."""
    with pytest.raises(MetadataError):
        parse_gcp_preempted(status, body, now=0.0)


# --- Azure -------------------------------------------------------------------------


def azure(*events: dict) -> bytes:
    return json.dumps({"DocumentIncarnation": 1, "Events": list(events)}).encode()


PREEMPT = {
    "EventId": "A123", "EventType": "Preempt", "ResourceType": "VirtualMachine",
    "Resources": ["vm-1"], "EventStatus": "Scheduled",
    "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
}


def test_azure_preempt_event_is_a_notice_with_not_before_deadline():
    """A Preempt event for this VM is a notice; NotBefore (RFC 1123) is the deadline."""
    notice = parse_azure_scheduled_events(200, azure(PREEMPT), resource_name="vm-1")
    assert notice is not None and notice.provider == "azure"
    assert notice.deadline == 1474309787.0
    assert "A123" in notice.detail


def test_azure_other_events_and_other_vms_are_not_notices():
    """Freeze/Reboot events, and Preempt events naming another VM, are not our notice."""
    freeze = {**PREEMPT, "EventType": "Freeze"}
    assert parse_azure_scheduled_events(200, azure(), "vm-1") is None
    assert parse_azure_scheduled_events(200, azure(freeze), "vm-1") is None
    assert parse_azure_scheduled_events(200, azure(PREEMPT), "vm-2") is None


def test_azure_unknown_vm_name_counts_every_preempt_event():
    """Without our VM name every Preempt counts (a needless drain beats a lost eviction)."""
    assert parse_azure_scheduled_events(200, azure(PREEMPT), None) is not None


def test_azure_started_event_has_no_deadline():
    """An event already started has NotBefore "" -> notice without deadline."""
    notice = parse_azure_scheduled_events(200, azure({**PREEMPT, "NotBefore": ""}), "vm-1")
    assert notice is not None and notice.deadline is None


@pytest.mark.parametrize(("status", "body"), [(400, b""), (200, b"{}"), (200, b'{"Events": 1}')])
def test_azure_unexpected_answers_raise(status, body):
    """A 400 (missing Metadata header) or a body without an Events list is an error."""
    with pytest.raises(MetadataError):
        parse_azure_scheduled_events(status, body)


# --- watcher policy ----------------------------------------------------------------


class ScriptedSource:
    """A source that replays a script of results (exceptions are raised)."""

    provider = "test"

    def __init__(self, *script):
        self.script = list(script)

    def poll(self):
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


def test_watcher_logs_errors_once_per_change_and_recovery_once():
    """Repeated identical failures log once; a different failure or recovery logs again."""
    notice = PreemptionNotice("test", None, "go")
    source = ScriptedSource(
        OSError("refused"), OSError("refused"), OSError("refused"),
        MetadataError("HTTP 500"), None, None, notice,
    )
    watcher = PreemptionWatcher(source, poll_interval_s=1.0)
    with capture_logs() as logs:
        results = [watcher.poll_once() for _ in range(7)]
    events = [e["event"] for e in logs]
    assert events == [
        "preemption_poll_failed", "preemption_poll_failed",
        "preemption_poll_recovered", "preemption_notice_received",
    ]
    assert results[-1] is notice and watcher.notice is notice
    assert watcher.polls == 7 and watcher.last_error is None


def test_make_watcher_none_is_off():
    """provider = "none" builds no watcher; unknown providers are a programming error."""
    assert make_watcher("none") is None
    assert make_watcher("aws", poll_interval_s=5).poll_interval_s == 5
    with pytest.raises(ValueError):
        make_watcher("ibm")


def test_drain_waits_until_the_lead_is_left():
    """A 120 s notice with a 60 s lead drains 60 s after it; with less left, at once."""
    from elasticd.agent.preemption import drain_delay_s

    notice = PreemptionNotice("aws", 1000.0, "test")
    assert drain_delay_s(notice, 60.0, now=880.0) == 60.0
    assert drain_delay_s(notice, 60.0, now=950.0) == 0.0
    assert drain_delay_s(notice, None, now=880.0) == 0.0  # no lead configured: at once


def test_drain_without_a_deadline_or_far_out_is_bounded():
    """No deadline drains at once; a deadline a day out waits at most MAX_DRAIN_DELAY_S."""
    from elasticd.agent.preemption import MAX_DRAIN_DELAY_S, drain_delay_s

    assert drain_delay_s(PreemptionNotice("azure", None, "started"), 60.0, now=0.0) == 0.0
    far = PreemptionNotice("aws", 86400.0, "skewed")
    assert drain_delay_s(far, 60.0, now=0.0) == MAX_DRAIN_DELAY_S
