"""The project-managed Kafka broker: config, real produce/consume, reuse of a running broker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer

from rankscope.cli.stack.broker import JVM_HEAP, LocalBroker, ensure_broker
from rankscope.config import ConfigError, Settings
from rankscope.topics import Topic


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_server_properties(tmp_path: Path) -> None:
    s = Settings(data_dir=str(tmp_path), cache_dir=str(tmp_path / "cache"),
                 kafka_port=19092, kafka_controller_port=19093)
    broker = LocalBroker(s)
    props = _props(broker.write_config().read_text())
    assert props == broker.server_properties()
    assert props["process.roles"] == "broker,controller"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:19092"
    assert props["log.dirs"] == str(tmp_path.resolve() / "kafka" / "data")
    assert props["auto.create.topics.enable"] == "false"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert props["offsets.topic.num.partitions"] == "4"
    for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                "transaction.state.log.min.isr", "share.coordinator.state.topic.replication.factor",
                "share.coordinator.state.topic.min.isr", "num.partitions"):
        assert props[key] == "1", key
    assert broker.libs_dir == (tmp_path / "cache").resolve() / f"kafka-{s.kafka_version}" / "libs"
    assert not broker.is_running()


def test_kafka_jvm_opts_follow_the_heap_flags(tmp_path: Path) -> None:
    s = Settings(data_dir=str(tmp_path), kafka_jvm_opts="-XX:+UseSerialGC '-Dx=a b'")
    assert LocalBroker(s).jvm_opts == [*JVM_HEAP, "-XX:+UseSerialGC", "-Dx=a b"]
    assert LocalBroker(s, jvm_opts=["-Xmx1g"]).jvm_opts == ["-Xmx1g", "-XX:+UseSerialGC", "-Dx=a b"]
    assert LocalBroker(Settings(data_dir=str(tmp_path))).jvm_opts == JVM_HEAP
    with pytest.raises(ConfigError, match="kafka_jvm_opts"):
        Settings(kafka_jvm_opts="-Dx='unclosed")


@pytest.mark.kafka
def test_the_session_broker_runs_with_the_configured_jvm_opts(kafka_settings: Settings) -> None:
    if kafka_settings.bootstrap_servers:
        pytest.fail("this test checks the suite's own local broker; unset RANKSCOPE_BOOTSTRAP_SERVERS")
    pid = LocalBroker(kafka_settings).pid()
    assert pid is not None
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert kafka_settings.kafka_jvm_opts
    for opt in kafka_settings.kafka_jvm_opts.split():
        assert opt in args, (opt, args[:12])


def test_ensure_broker_external_does_nothing(tmp_path: Path) -> None:
    s = Settings(data_dir=str(tmp_path), bootstrap_servers="kafka.example:9092")
    assert ensure_broker(s) == "kafka.example:9092"
    assert not (tmp_path / "kafka").exists()


@pytest.mark.kafka
def test_produce_consume_1000(fresh_topics: Settings) -> None:
    topic = Topic.STEPS.name_for(fresh_topics)
    n = 1000
    producer = Producer({"bootstrap.servers": fresh_topics.bootstrap, "linger.ms": 5})
    for i in range(n):
        producer.produce(topic, key=f"job{i % 7}".encode(), value=str(i).encode())
        producer.poll(0)
    assert producer.flush(30) == 0

    consumer = Consumer({"bootstrap.servers": fresh_topics.bootstrap, "group.id": f"g{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    seen: list[int] = []
    partitions: set[int] = set()
    deadline = time.monotonic() + 60
    try:
        while len(seen) < n and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=500, timeout=1.0):
                assert msg.error() is None, msg.error()
                seen.append(int(msg.value()))
                partitions.add(msg.partition())
    finally:
        consumer.close()
    assert sorted(seen) == list(range(n))
    assert len(partitions) > 1  # keys spread over the topic's partitions


@pytest.fixture
def local_broker_settings(kafka_settings: Settings, tmp_path: Path) -> Iterator[Settings]:
    """The session's local broker; with an external cluster configured, a local one of its own."""
    if kafka_settings.local_broker:
        yield kafka_settings
        return
    from tests.conftest import free_port

    own = kafka_settings.with_overrides(bootstrap_servers="", data_dir=str(tmp_path), kafka_port=free_port(),
                                        kafka_controller_port=free_port())
    broker = LocalBroker(own)
    broker.start(timeout_s=120)
    try:
        yield own
    finally:
        broker.stop()


@pytest.mark.kafka
def test_start_reuses_running_broker(local_broker_settings: Settings) -> None:
    kafka_settings = local_broker_settings
    broker = LocalBroker(kafka_settings)
    pid = broker.pid()
    assert pid is not None and broker.is_running()
    t0 = time.monotonic()
    assert broker.start() == kafka_settings.bootstrap
    assert time.monotonic() - t0 < 5
    assert broker.pid() == pid
    # Exactly one java kafka.Kafka process uses this data dir's config.
    config = str(broker.config_path).encode()
    procs = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kafka.Kafka" in args and config in args:
            procs.append(cmdline.parent.name)
    assert procs == [str(pid)]
