"""`rankscope trace` against a real broker where the replies topic is missing (a cluster set up
before it existed): a clear error naming the fix, not a silent wait for acks that cannot come."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from confluent_kafka import Producer

from rankscope.cli.stack.admin import delete_topics
from rankscope.config import Settings
from rankscope.protocol.envelope import Envelope, encode
from rankscope.topics import Topic

pytestmark = pytest.mark.kafka


def test_missing_replies_topic_is_named(fresh_topics: Settings) -> None:
    stats = Envelope(kind="stats", job="job-r", rank=-1, host="h", pid=1, seq=1, sent_ns=time.time_ns(),
                     body={"ranks": [{"rank": r, "ts_ns": 1, "step": 5, "window_steps": 5, "median_step_ns": 10,
                                      "p95_step_ns": 12, "median_busy_ns": 8, "median_comm_ns": 2, "busy_z": 0.0,
                                      "state": "running"} for r in (0, 1)]})
    producer = Producer({"bootstrap.servers": fresh_topics.bootstrap})
    producer.produce(Topic.STATS.name_for(fresh_topics), key=b"job-r", value=encode(stats))
    assert producer.flush(10) == 0
    delete_topics(fresh_topics, [Topic.REPLIES.name_for(fresh_topics)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env.update(fresh_topics.to_env())
    out = subprocess.run([sys.executable, "-m", "rankscope", "trace", "--job", "job-r", "--steps", "2",
                          "--timeout", "5"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"the replies topic {Topic.REPLIES.name_for(fresh_topics)} is missing" in out.stderr
    assert "rankscope kafka topics" in out.stderr
