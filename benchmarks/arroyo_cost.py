"""What sentry-arroyo's consumer loop costs per message against rankscope's own (rankscope/consuming.py).

The question the sink's and processors' consumer runtime was chosen by: does arroyo's per-message
cost keep the sink's capacity within 10%? Both arms drain the same backlog of real beat messages
from a real local broker, decode each with :func:`rankscope.protocol.envelope.decode` and commit
after each batch of work:

- ``rankscope``: ``open_consumer`` + ``consume(1000)`` batches, ``data_or_skip`` per message,
  a synchronous commit per batch (the sink's and the shard loop's shape);
- ``arroyo``: arroyo's ``StreamProcessor`` over its ``KafkaConsumer`` (one ``poll`` per message),
  ``RunTask(decode)`` then ``CommitOffsets`` (arroyo commits at most once a second).

The arms alternate ``--rounds`` times over one broker; each arm's CPU (``time.process_time``: the
Python thread and librdkafka's) per message is printed, and the difference per message, set
against the sink's measured CPU per message (``benchmarks.capacity``, ~30 µs), says how much
capacity arroyo would cost.

sentry-arroyo is not a rankscope dependency: ``pip install sentry-arroyo`` (or put it on
PYTHONPATH) to run this.

``python -m benchmarks.arroyo_cost [--messages 200000] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

from benchmarks._stack import local_stack
from rankscope.config import Settings
from rankscope.consuming import data_or_skip, open_consumer
from rankscope.protocol.envelope import Envelope, decode, encode

PARTITIONS = 4
SINK_US_PER_MSG = 30.0      # the sink's CPU per message in benchmarks.capacity here (2026-12-06: 29.8-35.0)


def beat(r: int, b: int, ranks: int) -> bytes:
    t0_ns = 1_800_000_000 * 10**9 + b * 10**9
    body: dict[str, Any] = {"step": [b], "start_ns": [t0_ns], "end_ns": [t0_ns + 9 * 10**8], "comm_ns": [0],
                            "hb_step": b, "since_step_s": 0.0, "dropped": 0, "world_size": ranks,
                            "local_rank": r % 8, "stacks": None}
    return encode(Envelope("beat", "bench", r, "h", r, b, t0_ns + 9 * 10**8, body))


def write_backlog(settings: Settings, topic: str, messages: int, ranks: int = 10_000) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": settings.bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
    p = Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 20, "compression.type": "lz4"})
    for i in range(messages):
        r = i % ranks
        while True:
            try:
                p.produce(topic, key=f"bench/{r}".encode(), value=beat(r, i // ranks, ranks))
                break
            except BufferError:
                p.poll(0.1)
        p.poll(0)
    assert p.flush(60) == 0


def rankscope_arm(settings: Settings, topic: str, messages: int) -> tuple[float, float]:
    c = open_consumer(settings, f"arm-rs-{uuid.uuid4().hex[:6]}",
                      {"auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    done = 0
    t0, w0 = time.process_time(), time.perf_counter()
    try:
        while done < messages:
            batch = c.consume(1000, 0.5)
            for m in batch:
                if data_or_skip(m, "bench"):
                    decode(m.value())
                    done += 1
            if batch:
                c.commit(asynchronous=False)
        return time.process_time() - t0, time.perf_counter() - w0
    finally:
        c.close()


def arroyo_arm(settings: Settings, topic: str, messages: int) -> tuple[float, float]:
    from arroyo.backends.kafka import KafkaConsumer
    from arroyo.backends.kafka.configuration import build_kafka_consumer_configuration
    from arroyo.processing import StreamProcessor
    from arroyo.processing.strategies import CommitOffsets, RunTask
    from arroyo.processing.strategies.abstract import ProcessingStrategyFactory
    from arroyo.types import Topic as ArroyoTopic

    done = [0]
    holder: list[Any] = []

    def work(msg: Any) -> Any:
        decode(msg.payload.value)
        done[0] += 1
        if done[0] >= messages:
            holder[0].signal_shutdown()
        return msg.payload

    class Factory(ProcessingStrategyFactory):   # type: ignore[type-arg]
        def create_with_partitions(self, commit: Any, partitions: Any) -> Any:
            return RunTask(work, CommitOffsets(commit))

    consumer = KafkaConsumer(build_kafka_consumer_configuration(
        {"bootstrap.servers": settings.bootstrap}, group_id=f"arm-ar-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest"))
    processor = StreamProcessor(consumer, ArroyoTopic(topic), Factory())
    holder.append(processor)
    t0, w0 = time.process_time(), time.perf_counter()
    processor.run()
    return time.process_time() - t0, time.perf_counter() - w0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    try:
        import arroyo  # noqa: F401
    except ImportError:
        print("benchmarks.arroyo_cost: sentry-arroyo is not installed (pip install sentry-arroyo)", file=sys.stderr)
        return 2
    us: dict[str, list[float]] = {"rankscope": [], "arroyo": []}
    with local_stack(processors=False) as settings:
        topic = f"{settings.topic_prefix}arroyo-cost"
        write_backlog(settings, topic, a.messages)
        for _ in range(a.rounds):
            for name, arm in (("rankscope", rankscope_arm), ("arroyo", arroyo_arm)):
                cpu, wall = arm(settings, topic, a.messages)
                us[name].append(1e6 * cpu / a.messages)
                print(f"{name:10s} {1e6 * cpu / a.messages:6.2f} µs CPU per message, {a.messages / wall:8.0f} msgs/s",
                      flush=True)
    med = {k: statistics.median(v) for k, v in us.items()}
    extra = med["arroyo"] - med["rankscope"]
    out = {"messages": a.messages, "rounds": a.rounds,
           "rankscope_us_per_msg": [round(x, 2) for x in us["rankscope"]],
           "arroyo_us_per_msg": [round(x, 2) for x in us["arroyo"]],
           "arroyo_extra_us_per_msg": round(extra, 2),
           "sink_capacity_change_pct": round(-100 * extra / (SINK_US_PER_MSG + extra), 1)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
