"""Talking to running ranks over Kafka: the job progress the processors publish, and the ranks' acks.

Shared by ``rankscope trace`` and the dashboard's Traces page: :func:`latest_stats` reads the tail
of the stats topic (each rank's latest step, step time and state), :func:`open_replies_reader` and
:func:`iter_acks` read the answers to a control request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from rankscope.config import Settings
from rankscope.consuming import one_off_group, open_consumer
from rankscope.kafka_client import client_conf
from rankscope.protocol.envelope import Envelope, decode
from rankscope.protocol.errors import WireError
from rankscope.topics import Topic


def known_ranks(settings: Settings, job: str, timeout_s: float = 5.0) -> dict[str, list[int]]:
    """Jobs and their ranks, from the latest stats published by the processors (tail of the stats topic)."""
    return {j: sorted(r["rank"] for r in rows) for j, rows in latest_stats(settings, timeout_s).items()}


def latest_stats(settings: Settings, timeout_s: float = 5.0) -> dict[str, list[dict[str, Any]]]:
    """Per job, the latest stats row of each rank (tail of the stats topic; a job's ranks arrive in
    messages from several shards)."""
    from confluent_kafka import KafkaException, TopicPartition

    topic = Topic.STATS.name_for(settings)
    c = open_consumer(settings, one_off_group("cli"), {"enable.auto.commit": False})
    latest: dict[str, dict[int, dict[str, Any]]] = {}
    jobs: dict[str, list[dict[str, Any]]] = {}
    try:
        md = c.list_topics(topic, timeout=timeout_s)
        parts = list(md.topics[topic].partitions) if topic in md.topics else []
        assign = []
        ends: dict[int, int] = {}
        for p in parts:
            try:
                lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            except KafkaException:  # partition leader not elected yet (new topic): nothing to read there
                continue
            if hi > lo:
                assign.append(TopicPartition(topic, p, max(lo, hi - 2000)))
                ends[p] = hi
        if not assign:
            return jobs
        c.assign(assign)
        remaining = {tp.partition for tp in assign}
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is None or msg.error():
                continue
            if (msg.offset() or 0) + 1 >= ends.get(msg.partition() or 0, 0):
                remaining.discard(msg.partition())
            try:
                env = decode(msg.value())
            except WireError:
                continue
            rows = latest.setdefault(env.job, {})
            for r in env.body["ranks"]:
                if isinstance(r, dict) and isinstance(r.get("rank"), int) and \
                        r.get("ts_ns", 0) >= rows.get(r["rank"], {}).get("ts_ns", 0):
                    rows[r["rank"]] = r
    finally:
        c.close()
    for job, rows in latest.items():
        jobs[job] = [rows[r] for r in sorted(rows)]
    return jobs


def open_replies_reader(settings: Settings, group_id: str, timeout_s: float = 10.0,
                        consumer_factory: Any = None) -> Any:
    """A consumer at the end of every partition of the replies topic, assigned before a request goes
    out so that no ack is missed (the CLI's and the dashboard's). Raises RuntimeError naming the fix
    when the topic is missing (a cluster set up before it existed)."""
    from confluent_kafka import OFFSET_END, TopicPartition

    replies = Topic.REPLIES.name_for(settings)
    conf = {"enable.auto.commit": False}
    consumer = (consumer_factory({**client_conf(settings, fatal=True), "group.id": group_id, **conf})
                if consumer_factory is not None else open_consumer(settings, group_id, conf))
    try:
        meta = consumer.list_topics(replies, timeout=timeout_s).topics.get(replies)
        if meta is None or meta.error is not None or not meta.partitions:
            raise RuntimeError(f"the replies topic {replies} is missing at {settings.bootstrap}, so no "
                               "acknowledgement can be read; create it with: rankscope kafka topics")
        consumer.assign([TopicPartition(replies, p, OFFSET_END) for p in meta.partitions])
        consumer.poll(0.5)  # take the assignment now
    except BaseException:
        consumer.close()
        raise
    return consumer


def iter_acks(consumer: Any, request_id: str, deadline: float, job: str | None = None,
              poll_s: float = 0.2) -> Iterator[Envelope]:
    """The ``ack`` envelopes answering ``request_id`` (of ``job`` if given) read from ``consumer``
    until the monotonic ``deadline``; undecodable and unrelated messages are skipped."""
    while time.monotonic() < deadline:
        msg = consumer.poll(poll_s)
        if msg is None or msg.error():
            continue
        try:
            env = decode(msg.value())
        except WireError:
            continue
        if env.kind == "ack" and env.body.get("request_id") == request_id and (job is None or env.job == job):
            yield env
