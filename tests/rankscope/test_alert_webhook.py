"""``rankscope alerts --webhook``: the two body formats, delivery with retries against a real HTTP
server on 127.0.0.1, and the forwarder's skip and commit rules with a fake consumer and clock."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from typing import Any

import pytest

from rankscope import cli
from rankscope.cli.commands.webhook_delivery import (
    DELIVERED,
    GAVE_UP,
    REJECTED,
    STOPPED,
    RetryPolicy,
    deliver,
    post_json,
    url_for_logs,
)
from rankscope.cli.commands.webhook_formats import ZERO_TIME, alertmanager_payload, rfc3339, slack_payload
from rankscope.cli.commands.webhook_forwarder import Forwarder, RecentDeliveries, forward
from rankscope.clock import ManualClock
from rankscope.config import Settings
from rankscope.protocol.alerts import Alert, StackGroup
from tests.webhook_server import WebhookServer

OPENED_NS = 1_764_806_400_123_456_789          # 2025-12-04T00:00:00.123456789Z
HANG = Alert(alert_id="j:hang:1", job="j", kind="hang", status="open", severity="critical", ranks=[3], step=599,
             opened_ns=OPENED_NS, updated_ns=OPENED_NS, version=1, summary="job j hung: rank 3 stuck <here> & there",
             stack_groups=[StackGroup(ranks=[3], thread="MainThread", frames=["train.py:56 hang_forever"],
                                      waiting_in_collective=False, count=1)],
             details={"threshold_s": 10.0, "stalled_ranks": [0, 1, 2, 3]})
NO_WAIT = RetryPolicy(attempts=3, first_backoff_s=0.0, max_backoff_s=0.0, timeout_s=5.0)


def version(alert: Alert, v: int, status: str = "update", **changes: Any) -> Alert:
    changes = {"updated_ns": alert.opened_ns + v * 1_000_000_000, **changes}
    return dataclasses.replace(alert, version=v, status=status, **changes)


def refused_url() -> str:
    """An http URL nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"


# Formats ------------------------------------------------------------------------------------------
def test_rfc3339_keeps_nanoseconds_without_trailing_zeros() -> None:
    assert rfc3339(OPENED_NS) == "2025-12-04T00:00:00.123456789Z"
    assert rfc3339(1_764_806_400_500_000_000) == "2025-12-04T00:00:00.5Z"
    assert rfc3339(0) == "1970-01-01T00:00:00Z"


def test_alertmanager_body_of_a_firing_and_a_resolved_version() -> None:
    body = alertmanager_payload(HANG)
    assert (body["version"], body["status"], body["receiver"], body["truncatedAlerts"]) == ("4", "firing", "rankscope", 0)
    [a] = body["alerts"]
    assert a["labels"] == {"alertname": "RankscopeHang", "job": "j", "kind": "hang", "severity": "critical"}
    assert a["annotations"]["summary"] == HANG.summary
    assert (a["annotations"]["alert_id"], a["annotations"]["version"], a["annotations"]["ranks"]) == ("j:hang:1", "1", "3")
    assert all(isinstance(v, str) for v in a["annotations"].values())
    assert (a["status"], a["startsAt"], a["endsAt"]) == ("firing", "2025-12-04T00:00:00.123456789Z", ZERO_TIME)
    assert body["commonLabels"] == a["labels"] and body["groupLabels"] == {"alertname": "RankscopeHang", "job": "j"}
    assert body["groupKey"] == '{}:{alertname="RankscopeHang", job="j"}'
    assert len(a["fingerprint"]) == 16
    assert alertmanager_payload(version(HANG, 2))["status"] == "firing"        # an update still fires

    resolved = version(HANG, 3, "resolved", resolved_ns=OPENED_NS + 60_000_000_000)
    body = alertmanager_payload(resolved)
    [a] = body["alerts"]
    assert (body["status"], a["status"]) == ("resolved", "resolved")
    assert (a["startsAt"], a["endsAt"]) == ("2025-12-04T00:00:00.123456789Z", "2025-12-04T00:01:00.123456789Z")
    assert a["fingerprint"] == alertmanager_payload(HANG)["alerts"][0]["fingerprint"]    # the same alert
    assert json.loads(json.dumps(body)) == body


def test_alertmanager_alertname_of_every_kind() -> None:
    names = {k: alertmanager_payload(dataclasses.replace(HANG, kind=k))["alerts"][0]["labels"]["alertname"]
             for k in ("dead_rank", "slow_rank", "abnormal_worker", "rank_failed", "collective_mismatch")}
    assert names == {"dead_rank": "RankscopeDeadRank", "slow_rank": "RankscopeSlowRank",
                     "abnormal_worker": "RankscopeAbnormalWorker", "rank_failed": "RankscopeRankFailed",
                     "collective_mismatch": "RankscopeCollectiveMismatch"}


def test_slack_body_is_one_text_with_escaped_summary() -> None:
    body = slack_payload(HANG)
    assert list(body) == ["text"]
    text = body["text"]
    assert text.startswith(":rotating_light: *RankscopeHang* firing (critical) in job `j`")
    assert "stuck &lt;here&gt; &amp; there" in text and "<here>" not in text
    assert "ranks 3 · step 599 · version 1 · `j:hang:1`" in text
    assert slack_payload(version(HANG, 2))["text"].startswith(":rotating_light: *RankscopeHang* still firing")
    assert slack_payload(version(HANG, 3, "resolved"))["text"].startswith(":white_check_mark: *RankscopeHang* resolved")
    assert slack_payload(dataclasses.replace(HANG, severity="warning"))["text"].startswith(":warning:")


# Delivery against a real HTTP server ---------------------------------------------------------------
def test_post_json_sends_json_and_returns_the_status() -> None:
    with WebhookServer([503]) as server:
        assert post_json(server.url("/a"), b'{"x": 1}', 5.0) == 503
        assert post_json(server.url("/b"), b'{"x": 2}', 5.0) == 200
        assert server.bodies() == [{"x": 2}] and server.paths == ["/a", "/b"]
        assert server.headers[1]["Content-Type"] == "application/json"


def test_5xx_answers_are_retried_with_backoff_until_delivered() -> None:
    waits: list[float] = []
    policy = RetryPolicy(attempts=4, first_backoff_s=0.5, max_backoff_s=0.75, timeout_s=5.0)
    with WebhookServer([500, 503, 502]) as server:
        result = deliver(server.url(), b'{"n": 1}', policy, wait=lambda s: bool(waits.append(s)))
        assert (result.outcome, result.attempts) == (DELIVERED, 4)
        assert server.bodies() == [{"n": 1}]
    assert waits == [0.5, 0.75, 0.75]          # doubling, capped


def test_retries_are_bounded_then_it_gives_up() -> None:
    with WebhookServer([500] * 5) as server:
        result = deliver(server.url(), b"{}", NO_WAIT)
        assert (result.outcome, result.attempts, result.error) == (GAVE_UP, 3, "HTTP 500")
        assert server.bodies() == [] and len(server.paths) == 3


def test_a_connection_error_is_retried_and_given_up() -> None:
    result = deliver(refused_url(), b"{}", NO_WAIT)
    assert (result.outcome, result.attempts) == (GAVE_UP, 3)
    assert "refused" in result.error.lower() or "URLError" in result.error


def test_a_4xx_is_rejected_at_once_but_429_is_retried() -> None:
    with WebhookServer([404, 429]) as server:
        assert deliver(server.url(), b"{}", NO_WAIT).outcome == REJECTED
        assert len(server.paths) == 1
        result = deliver(server.url(), b"{}", NO_WAIT)
        assert (result.outcome, result.attempts) == (DELIVERED, 2)


def test_a_stop_during_backoff_ends_the_delivery_as_stopped() -> None:
    result = deliver(refused_url(), b"{}", RetryPolicy(attempts=5), wait=lambda s: True)
    assert (result.outcome, result.attempts) == (STOPPED, 1)


def test_retry_policy_is_checked_and_bounded() -> None:
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="backoff"):
        RetryPolicy(first_backoff_s=5.0, max_backoff_s=1.0)
    assert RetryPolicy(attempts=3, first_backoff_s=1.0, max_backoff_s=30.0, timeout_s=10.0).worst_case_s() == 33.0


def test_logged_url_keeps_no_path_secret() -> None:
    assert url_for_logs("https://hooks.slack.com/services/T0/B0/s3cret") == "https://hooks.slack.com/..."
    assert url_for_logs("http://127.0.0.1:9093/api") == "http://127.0.0.1:9093/..."


# The forwarder ------------------------------------------------------------------------------------
class Message:
    def __init__(self, value: bytes, offset: int) -> None:
        self._value, self._offset = value, offset

    def value(self) -> bytes:
        return self._value

    def offset(self) -> int:
        return self._offset

    def partition(self) -> int:
        return 0

    def error(self) -> None:
        return None


class FakeConsumer:
    """Hands out ``values`` in order, records commits, sets ``stop`` once all were read."""

    def __init__(self, values: list[bytes], stop: threading.Event) -> None:
        self.messages = [Message(v, i) for i, v in enumerate(values)]
        self.committed: list[int] = []
        self.stop = stop

    def poll(self, timeout: float) -> Message | None:
        if not self.messages:
            self.stop.set()
            return None
        return self.messages.pop(0)

    def commit(self, *, message: Message, asynchronous: bool) -> None:
        assert asynchronous is False
        self.committed.append(message.offset())


def test_forwarder_delivers_each_version_once_and_commits_after_each() -> None:
    clock = ManualClock(OPENED_NS / 1e9 + 10)
    v1, v2 = HANG, version(HANG, 2)
    values = [v1.to_json(), v2.to_json(), v1.to_json(), b"not json", dataclasses.replace(HANG, job="other").to_json()]
    stop = threading.Event()
    consumer = FakeConsumer(values, stop)
    with WebhookServer() as server:
        fwd = Forwarder(server.url(), alertmanager_payload, NO_WAIT, job="j", clock=clock)
        forward(consumer, fwd, stop, poll_s=0.01)
        got = [(b["alerts"][0]["annotations"]["alert_id"], b["alerts"][0]["annotations"]["version"])
               for b in server.bodies()]
    assert got == [("j:hang:1", "1"), ("j:hang:1", "2")]
    assert consumer.committed == [0, 1, 2, 3, 4]
    assert fwd.counts == {"delivered": 2, "duplicate": 1, "malformed": 1, "other_job": 1}


def test_forwarder_skips_what_it_cannot_deliver_and_commits_it() -> None:
    stop = threading.Event()
    consumer = FakeConsumer([HANG.to_json(), version(HANG, 2).to_json()], stop)
    with WebhookServer([500, 500, 500]) as server:
        fwd = Forwarder(server.url(), slack_payload, NO_WAIT, clock=ManualClock(OPENED_NS / 1e9))
        forward(consumer, fwd, stop, poll_s=0.01)
        assert [b["text"].split("\n")[1] for b in server.bodies()] == ["ranks 3 · step 599 · version 2 · `j:hang:1`"]
    assert consumer.committed == [0, 1]
    assert fwd.counts == {"gave_up": 1, "delivered": 1}


def test_forwarder_stopped_mid_delivery_leaves_the_offset_uncommitted() -> None:
    stop = threading.Event()
    consumer = FakeConsumer([HANG.to_json(), version(HANG, 2).to_json()], stop)
    fwd = Forwarder(refused_url(), alertmanager_payload, RetryPolicy(attempts=3), wait=lambda s: True,
                    clock=ManualClock(OPENED_NS / 1e9))
    forward(consumer, fwd, stop, poll_s=0.01)
    assert consumer.committed == [] and fwd.counts == {"stopped": 1}
    assert len(consumer.messages) == 1                     # the loop ended at once


def test_forwarder_skips_versions_older_than_max_age() -> None:
    clock = ManualClock(OPENED_NS / 1e9 + 3600)
    with WebhookServer() as server:
        fwd = Forwarder(server.url(), alertmanager_payload, NO_WAIT, max_age_s=600, clock=clock)
        assert fwd.handle(HANG.to_json()) == "stale"
        assert fwd.handle(version(HANG, 2, updated_ns=clock.wall_ns() - 1_000_000_000).to_json()) == "delivered"
        assert len(server.bodies()) == 1


def test_recent_deliveries_forget_the_oldest() -> None:
    recent = RecentDeliveries(capacity=2)
    for key in (("a", 1), ("a", 2), ("b", 1)):
        recent.add(key)
    assert ("a", 1) not in recent and ("a", 2) in recent and ("b", 1) in recent


# The command line ---------------------------------------------------------------------------------
def test_webhook_flags_are_parsed_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.build_parser().parse_args(["alerts", "--webhook", "http://127.0.0.1:1/x", "--format", "slack"])
    assert (args.webhook, args.format, args.group, args.attempts, args.max_age) == (
        "http://127.0.0.1:1/x", "slack", None, 5, 86400.0)
    settings = Settings()
    for argv, message in ((["alerts", "--webhook", "ftp://x"], "http:// or https://"),
                          (["alerts", "--webhook", "http://x", "--attempts", "0"], "attempts"),
                          (["alerts", "--format", "slack"], "go with --webhook")):
        args = cli.build_parser().parse_args(argv)
        assert args.func(args, settings) == 2
        assert message in capsys.readouterr().err
