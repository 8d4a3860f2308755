"""rankscope.dashboard.control against a real broker: the request reaches the control topic, acks come back on the replies topic."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import OFFSET_END, Consumer, Producer, TopicPartition

from rankscope.dashboard import control
from rankscope.protocol.envelope import Envelope, decode, encode
from rankscope.topics import Topic

pytestmark = pytest.mark.kafka


def _fake_ranks(settings, ranks: list[int], ready: threading.Event, seen: list) -> None:
    """Two 'ranks' that answer each control message with an ack, like producers/control.py."""
    topic = Topic.CONTROL.name_for(settings)
    replies = Topic.REPLIES.name_for(settings)
    c = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": "fake-ranks", "enable.auto.commit": False})
    md = c.list_topics(topic, timeout=10)
    c.assign([TopicPartition(topic, p, OFFSET_END) for p in md.topics[topic].partitions])
    c.poll(0.5)
    ready.set()
    p = Producer({"bootstrap.servers": settings.bootstrap})
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and not seen:
            msg = c.poll(0.2)
            if msg is None or msg.error():
                continue
            env = decode(msg.value())
            if env.kind != "control":
                continue
            seen.append(env)
            for r in ranks:
                body = {"request_id": env.body["request_id"], "status": "accepted" if r == 0 else "rejected",
                        "detail": f"rank {r} says hi"}
                ack = Envelope(kind="ack", job=env.job, rank=r, host="h", pid=1, seq=1, sent_ns=time.time_ns(),
                               body=body)
                p.produce(replies, key=env.job.encode(), value=encode(ack))
            p.flush(10)
    finally:
        c.close()


def test_request_window_round_trip(fresh_topics):
    ready, seen = threading.Event(), []
    t = threading.Thread(target=_fake_ranks, args=(fresh_topics, [0, 1], ready, seen), daemon=True)
    t.start()
    assert ready.wait(30)
    req = control.TraceRequest(job="job-k", ranks=[0, 1], steps=4, mode="every_s", every_s=30)
    t0 = time.monotonic()
    acks = control.request_window(fresh_topics, req, wait_s=90, expect_ranks=[0, 1])
    assert time.monotonic() - t0 < 85  # returned once both ranks answered, not at the deadline
    t.join(10)
    assert seen[0].body["request_id"] == req.request_id and seen[0].body["args"]["every_s"] == 30.0
    assert sorted((a.rank, a.status) for a in acks) == [(0, "accepted"), (1, "rejected")]
    assert acks[0].detail.startswith("rank ")


def test_request_window_without_answers_waits_and_returns_nothing(fresh_topics):
    req = control.TraceRequest(job="nobody-home", stop=True)
    t0 = time.monotonic()
    assert control.request_window(fresh_topics, req, wait_s=1.5) == []
    assert 1.4 < time.monotonic() - t0 < 15
