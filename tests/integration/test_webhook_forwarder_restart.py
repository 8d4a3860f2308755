"""``rankscope alerts --webhook`` against the real broker: every alert version published on the alerts
topic reaches a local HTTP server once, also across a SIGTERM and a restart of the forwarder (its
consumer group's committed offsets say what was delivered)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from rankscope.alert_schema import validate
from rankscope.config import Settings
from rankscope.protocol.alerts import Alert
from rankscope.topics import Topic
from tests.integration.helpers import REPO, child_env, stop_process, tail, wait_until
from tests.webhook_server import WebhookServer

pytestmark = [pytest.mark.kafka]


def publish(settings: Settings, alerts: list[Alert]) -> None:
    producer = Producer({"bootstrap.servers": settings.bootstrap})
    for a in alerts:
        validate(json.loads(a.to_json()))
        producer.produce(Topic.ALERTS.name_for(settings), key=a.job.encode(), value=a.to_json())
    assert producer.flush(30) == 0


def start_forwarder(settings: Settings, url: str, group: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "rankscope", "alerts", "--webhook", url, "--group", group],
                            env=child_env(settings), cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_and_count(proc: subprocess.Popen[bytes], log: Path) -> str:
    """SIGTERM the forwarder; the counts its last log line reports."""
    stop_process(proc)
    assert proc.returncode == 0, tail(log)
    counts = re.findall(r"stopped; alerts (.*)", log.read_text())
    assert counts, tail(log)
    return counts[-1]


def delivered(server: WebhookServer) -> list[tuple[str, str, str]]:
    return [(b["alerts"][0]["annotations"]["alert_id"], b["alerts"][0]["annotations"]["version"], b["status"])
            for b in server.bodies()]


def test_each_alert_version_reaches_the_webhook_once_across_a_restart(fresh_topics: Settings, tmp_path: Path) -> None:
    settings = fresh_topics
    now = time.time_ns()
    hang = Alert(alert_id=f"j:hang:{now}", job="j", kind="hang", status="open", severity="critical", ranks=[3],
                 step=599, opened_ns=now, updated_ns=now, version=1, summary="job j hung: rank 3 stuck after step 599",
                 details={"threshold_s": 10.0, "stalled_ranks": [0, 1, 2, 3]})
    slow = dataclasses.replace(hang, alert_id=f"j:slow_rank:{now}", kind="slow_rank", severity="warning", ranks=[1],
                               summary="job j: rank 1 is slow", details={})
    hang_v2 = dataclasses.replace(hang, status="update", version=2, updated_ns=now + 1, ranks=[2, 3])
    hang_v3 = dataclasses.replace(hang, status="resolved", version=3, updated_ns=now + 2, resolved_ns=now + 2)
    group, log = f"webhook-{uuid.uuid4().hex[:8]}", tmp_path / "forwarder.log"

    with WebhookServer() as server:
        publish(settings, [hang, slow, hang_v2])
        proc = start_forwarder(settings, server.url("/alertmanager"), group, log)
        try:
            wait_until(lambda: len(server.bodies()) >= 3, 90, f"3 deliveries; log:\n{tail(log)}")
        finally:
            first_counts = stop_and_count(proc, log)
        assert "'delivered': 3" in first_counts, first_counts

        publish(settings, [hang_v3])
        proc = start_forwarder(settings, server.url("/alertmanager"), group, log)
        try:
            wait_until(lambda: len(server.bodies()) >= 4, 90, f"the 4th delivery; log:\n{tail(log)}")
            time.sleep(2.0)     # room for a duplicate to arrive, were one sent
        finally:
            second_counts = stop_and_count(proc, log)
        assert second_counts == "{'delivered': 1}", second_counts

        assert sorted(delivered(server)) == sorted([
            (hang.alert_id, "1", "firing"), (slow.alert_id, "1", "firing"),
            (hang.alert_id, "2", "firing"), (hang.alert_id, "3", "resolved")])
        assert set(server.paths) == {"/alertmanager"}
