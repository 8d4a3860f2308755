"""State rebuilt from recent input when a worker takes partitions (start, restart, rebalance).

The processors keep no state store: what a worker needs for a steps partition is the last
``rebuild_horizon_s`` of that partition (every fold is idempotent, so reading it again next to
faust's own re-delivery changes nothing), and what it needs for a ``shards`` partition is the
incidents still open on the alerts topic (same key, same partition count, so the same partition
number). Reads use a plain confluent-kafka consumer with ``assign`` (no group, no commit) from the
offset at the horizon's start to the partition's end at the time of the call. Blocking: run it
in an executor thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from functools import partial

from confluent_kafka import TopicPartition

from rankscope.config import Settings
from rankscope.consuming import one_off_group, open_consumer, retrying
from rankscope.protocol.alerts import Alert
from rankscope.protocol.envelope import decode
from rankscope.protocol.errors import WireError
from rankscope.stream_processors.shard import ShardJob
from rankscope.topics import Topic

log = logging.getLogger("rankscope.processors")
READ_TIMEOUT_S = 60.0


def read_since(settings: Settings, topic: str, partitions: list[int], since_ms: int) -> Iterator[tuple[int, bytes]]:
    """(partition, value) of every message of ``partitions`` at or after ``since_ms``, up to the
    end each partition had when the call began."""
    if not partitions:
        return
    consumer = open_consumer(settings, one_off_group("rebuild"), {
                         "enable.auto.commit": False, "enable.partition.eof": False,
                         "fetch.max.bytes": 16 * 1024 * 1024, "logger": log, "log_level": 3})
    try:
        def end_of(p: int) -> int:
            return int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1])

        ends = {p: retrying(partial(end_of, p), f"end offset of {topic} [{p}]") for p in partitions}
        starts = retrying(lambda: consumer.offsets_for_times([TopicPartition(topic, p, since_ms) for p in partitions],
                                                              timeout=10), f"offsets of {topic} at the horizon")
        todo = {}
        for tp in starts:
            first = tp.offset if tp.offset >= 0 else ends[tp.partition]
            if first < ends[tp.partition]:
                todo[tp.partition] = ends[tp.partition]
                tp.offset = first
        if not todo:
            return
        consumer.assign([tp for tp in starts if tp.partition in todo])
        deadline = time.monotonic() + READ_TIMEOUT_S
        while todo and time.monotonic() < deadline:
            for msg in consumer.consume(2000, timeout=0.5):
                if msg.error():
                    continue
                p, offset, value = msg.partition(), msg.offset(), msg.value()
                end = todo.get(p) if p is not None else None
                if p is None or end is None or offset is None:
                    continue
                if value is not None:
                    yield p, value
                if offset + 1 >= end:
                    del todo[p]
        if todo:
            log.warning("rebuild of %s partitions %s stopped at its %.0f s deadline", topic, sorted(todo), READ_TIMEOUT_S)
    finally:
        consumer.close()


def rebuild_shards(settings: Settings, partitions: list[int], now_s: float) -> list[ShardJob]:
    """The ShardJobs of ``partitions`` from their last ``rebuild_horizon_s`` of input."""
    shards: dict[tuple[int, str], ShardJob] = {}
    since_ms = int((now_s - settings.rebuild_horizon_s) * 1000)
    n = 0
    t0 = time.monotonic()
    for p, value in read_since(settings, Topic.STEPS.name_for(settings), partitions, since_ms):
        try:
            env = decode(value)
        except WireError:
            continue   # counted and dead-lettered when the agent reads it
        if env.kind not in ("beat", "steps", "heartbeat", "exit"):
            continue
        sj = shards.get((p, env.job))
        if sj is None:
            sj = shards[(p, env.job)] = ShardJob(env.job, p)
        sj.apply(env, now_s, settings)
        n += 1
    if partitions:
        log.warning("rebuilt partitions %s of %s from %d messages (%.1f s) in %.2f s", sorted(partitions),
                    Topic.STEPS.name_for(settings), n, settings.rebuild_horizon_s, time.monotonic() - t0)
    for sj in shards.values():
        sj.new_steps = 0
    return list(shards.values())


def open_incidents(settings: Settings, partitions: list[int], now_s: float) -> dict[int, list[Alert]]:
    """The alerts of ``partitions`` published in the last ``incident_horizon_s``, oldest first."""
    out: dict[int, list[Alert]] = {p: [] for p in partitions}
    since_ms = int((now_s - settings.incident_horizon_s) * 1000)
    for p, value in read_since(settings, Topic.ALERTS.name_for(settings), partitions, since_ms):
        try:
            out[p].append(Alert.from_json(value))
        except ValueError:
            continue
    return out
