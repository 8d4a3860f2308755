"""The consumer runtime (rankscope/consuming.py): the only place a Kafka consumer is built, and the
loop steps the sink and the processors share (message errors, dead letters, rewinding)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from rankscope import consuming
from rankscope.clock import ManualClock
from rankscope.config import Settings
from rankscope.protocol.deadletter import DeadLetter, DeadLetterCounter
from tests.kafka_fakes import Message

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = ("rankscope", "producers", "stream_processors", "offline", "storage", "dashboard", "benchmarks")
CONSUMER_CALL = re.compile(r"\bConsumer\(")


def test_every_consumer_is_opened_by_the_runtime() -> None:
    sites = [f"{p.relative_to(REPO)}:{n}" for d in PRODUCTION for p in sorted((REPO / d).rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if CONSUMER_CALL.search(line)]
    assert sites == [f"rankscope/consuming.py:{_line_of('return Consumer(base)')}"], sites


def test_the_check_finds_a_planted_consumer() -> None:
    assert CONSUMER_CALL.search('    c = Consumer({"group.id": "x"})')
    assert not CONSUMER_CALL.search("class ShardLoop:") and not CONSUMER_CALL.search("def open_consumer(")


def _line_of(text: str) -> int:
    lines = (REPO / "rankscope" / "consuming.py").read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


class _Recorder:
    def __init__(self, conf: dict[str, Any]) -> None:
        self.conf = conf


def test_open_consumer_builds_from_settings_with_security(monkeypatch: pytest.MonkeyPatch) -> None:
    import confluent_kafka

    monkeypatch.setattr(confluent_kafka, "Consumer", _Recorder)
    s = Settings(bootstrap_servers="127.0.0.1:9092", kafka_security_protocol="SASL_PLAINTEXT",
                 kafka_sasl_username="u", kafka_sasl_password="p")
    c = consuming.open_consumer(s, "g1", {"enable.auto.commit": False})
    assert c.conf["group.id"] == "g1" and c.conf["enable.auto.commit"] is False
    assert c.conf["bootstrap.servers"] == "127.0.0.1:9092" and c.conf["sasl.username"] == "u"
    assert callable(c.conf["error_cb"])


def test_open_consumer_from_a_ranks_configuration_passes_errors_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import confluent_kafka

    monkeypatch.setattr(confluent_kafka, "Consumer", _Recorder)
    seen: list[Any] = []
    c = consuming.open_consumer({"bootstrap.servers": "127.0.0.1:1"}, "rank-g", {"auto.offset.reset": "latest"},
                                fatal=False, on_error=seen.append)
    assert c.conf["group.id"] == "rank-g" and c.conf["auto.offset.reset"] == "latest"
    err = KafkaError(KafkaError._TRANSPORT)
    c.conf["error_cb"](err)
    assert seen == [err]
    assert consuming.one_off_group("cli").startswith("rankscope-cli-")
    assert consuming.one_off_group("cli") != consuming.one_off_group("cli")


def test_data_or_skip_tells_data_from_errors() -> None:
    counted: list[str] = []
    assert consuming.data_or_skip(Message(), "sink", counted.append)
    assert not consuming.data_or_skip(Message(error=KafkaError(KafkaError._PARTITION_EOF)), "sink", counted.append)
    assert counted == []
    assert not consuming.data_or_skip(Message(error=KafkaError(KafkaError._TRANSPORT)), "sink", counted.append)
    assert counted == ["consumer_errors"]
    with pytest.raises(KafkaException):
        consuming.data_or_skip(Message(error=KafkaError(KafkaError._FATAL, fatal=True)), "sink", counted.append)


def test_rewind_seeks_each_partition_to_its_first_message() -> None:
    class Seeker:
        seeks: list[tuple[str, int, int]] = []

        def seek(self, tp: Any) -> None:
            self.seeks.append((tp.topic, tp.partition, tp.offset))

    c = Seeker()
    consuming.rewind(c, [Message("a", 0, 7), Message("a", 0, 5), Message("a", 1, 9), Message("b", 0, 3),
                         Message("b", 0, 1, error=KafkaError(KafkaError._TRANSPORT))])
    assert sorted(c.seeks) == [("a", 0, 5), ("a", 1, 9), ("b", 0, 3)]


def test_dead_letters_are_produced_counted_and_wait_for_room() -> None:
    class Producer:
        def __init__(self) -> None:
            self.sent: list[tuple[str, bytes, bytes]] = []
            self.full = 2
            self.polls = 0

        def produce(self, topic: str, key: bytes, value: bytes, **_: Any) -> None:
            if self.full:
                self.full -= 1
                raise BufferError("queue full")
            self.sent.append((topic, key, value))

        def poll(self, _timeout: float) -> int:
            self.polls += 1
            return 0

    class Metrics:
        def __init__(self) -> None:
            self.seen: list[tuple[str, str]] = []

        def dead_letter(self, stage: str, reason: str) -> None:
            self.seen.append((stage, reason))

    p, counter, metrics = Producer(), DeadLetterCounter(), Metrics()
    dl = consuming.DeadLetters(p, "rankscope.deadletter", "sink", counter, ManualClock(start_s=123e-9), metrics)
    dl.send_for(Message("rankscope.steps", 2, 41, b"\xc1garbage"), "not_msgpack", "bad first byte")
    assert counter.snapshot() == {"sink:not_msgpack": 1} and metrics.seen == [("sink", "not_msgpack")]
    assert p.polls >= 3     # served delivery reports twice while the queue was full
    ((topic, key, value),) = p.sent
    assert topic == "rankscope.deadletter" and key == b"rankscope.steps"
    letter = DeadLetter.from_json(value)
    assert (letter.source_topic, letter.partition, letter.offset, letter.stage, letter.reason, letter.ts_ns) == (
        "rankscope.steps", 2, 41, "sink", "not_msgpack", ManualClock(start_s=123e-9).wall_ns())
    assert json.loads(value)["payload_b64"]


class Sleeps:
    """:func:`retrying`'s sleeps, which advance a :class:`ManualClock` (started at 0)."""

    def __init__(self) -> None:
        self.clock = ManualClock(start_s=0.0)
        self.slept: list[float] = []

    def __call__(self, s: float) -> None:
        self.slept.append(s)
        self.clock.advance(s)


def failing(errors: list[int], value: int = 7) -> Any:
    """A call that raises a KafkaException of each code in ``errors`` in turn, then returns ``value``."""
    left = list(errors)

    def call() -> int:
        if left:
            raise KafkaException(KafkaError(left.pop(0)))
        return value
    return call


def test_retrying_waits_out_a_moving_leader() -> None:
    sleeps = Sleeps()
    call = failing([KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError._TRANSPORT])
    assert consuming.retrying(call, "end offset", clock=sleeps.clock.monotonic, sleep=sleeps) == 7
    assert sleeps.slept == [0.2, 0.4, 0.8]


def test_retrying_raises_other_errors_at_once_and_transient_ones_at_its_deadline() -> None:
    sleeps = Sleeps()
    now = sleeps.clock.monotonic
    with pytest.raises(KafkaException) as e:
        consuming.retrying(failing([KafkaError.TOPIC_AUTHORIZATION_FAILED]), "end offset", clock=now, sleep=sleeps)
    assert e.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED and sleeps.slept == []
    with pytest.raises(KafkaException) as e:
        consuming.retrying(failing([KafkaError.NOT_LEADER_FOR_PARTITION] * 100), "end offset", timeout_s=5.0,
                           clock=now, sleep=sleeps)
    assert e.value.args[0].code() == KafkaError.NOT_LEADER_FOR_PARTITION
    assert now() <= 5.0 and sum(sleeps.slept) == pytest.approx(now()) and max(sleeps.slept) == 2.0
    with pytest.raises(ValueError):
        consuming.retrying(lambda: int("x"), "not Kafka", clock=now, sleep=sleeps)
