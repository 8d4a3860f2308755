"""The one home of rankscope's Kafka consumers and of the steps their loops share.

Every consumer in rankscope (the sink, the processors' shard loop and their rebuild reads, the ranks'
control readers, the CLI's tails) is opened by :func:`open_consumer`, so security, extras and the
one-line report of a rejected login apply to all of them alike. The loops share:

- :func:`data_or_skip`: what a polled message that carries an error means (end of a partition:
  skip; fatal: raise; else: log, count and skip);
- :class:`DeadLetters`: a message that fails validation goes to the deadletter topic with its
  reason, counted by stage and reason, never stopping the loop;
- :func:`rewind`: seek back to the first of messages taken but not processed, so none is skipped;
- :func:`retrying`: a metadata call (watermarks, offsets for times) repeated while the cluster moves
  a partition's leader, instead of failing the read that asked.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from rankscope.kafka_client import auth_error_cb, client_conf
from rankscope.protocol.deadletter import DeadLetter, DeadLetterCounter

if TYPE_CHECKING:
    from rankscope.clock import Clock
    from rankscope.config import Settings

log = logging.getLogger("rankscope.consuming")
T = TypeVar("T")

#: Errors of a metadata call that last while the cluster elects a partition's new leader or a
#: broker restarts (librdkafka's names): retried by :func:`retrying`.
TRANSIENT_ERRORS = frozenset({
    "NOT_LEADER_FOR_PARTITION", "LEADER_NOT_AVAILABLE", "REQUEST_TIMED_OUT", "NOT_ENOUGH_REPLICAS",
    "UNKNOWN_TOPIC_OR_PART", "_TRANSPORT", "_TIMED_OUT", "_ALL_BROKERS_DOWN", "_WAIT_COORD",
})


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``KafkaException`` whose error :func:`retrying` waits out."""
    from confluent_kafka import KafkaException

    if not isinstance(exc, KafkaException) or not exc.args:
        return False
    err = exc.args[0]
    return bool(err.retriable()) or err.name() in TRANSIENT_ERRORS


def retrying(call: Callable[[], T], what: str, timeout_s: float = 30.0,
             clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``, repeated while it raises a :func:`transient` Kafka error, with a backoff from 0.2 s
    to 2 s, for up to ``timeout_s``; then (or on any other error) its exception is raised. After a
    broker dies its partitions' leadership moves within seconds, and a client's metadata may name the
    dead leader a moment longer: a read that asks then waits instead of failing its worker."""
    deadline = clock() + timeout_s
    delay = 0.2
    while True:
        try:
            return call()
        except Exception as e:
            if not transient(e) or clock() + delay > deadline:
                raise
            log.warning("%s: %s; retrying in %.1f s", what, e, delay)
            sleep(delay)
            delay = min(2.0, delay * 2)


def one_off_group(purpose: str) -> str:
    """A consumer group of its own for a reader that commits nothing (a CLI tail, a rebuild)."""
    return f"rankscope-{purpose}-{uuid.uuid4().hex[:8]}"


def open_consumer(source: Settings | Mapping[str, Any], group: str, conf: Mapping[str, Any] | None = None, *,
                  fatal: bool = True, on_error: Callable[[Any], None] | None = None) -> Any:
    """A confluent-kafka ``Consumer`` of ``group``: from ``source``'s settings (bootstrap, security,
    ``kafka_extra``; :func:`~rankscope.kafka_client.client_conf`), or a rank's ready client
    configuration, then ``conf``. Authentication and TLS failures are reported once (and raise from
    the consumer's poll when ``fatal``); ``on_error`` sees every client error after that."""
    from confluent_kafka import Consumer

    if isinstance(source, Mapping):
        base = {**source, "group.id": group, **(conf or {})}
        base["error_cb"] = auth_error_cb(base, on_error, fatal=fatal)
    else:
        base = client_conf(source, {"group.id": group, **(conf or {})}, fatal=fatal)
        if on_error is not None:
            then = base["error_cb"]
            base["error_cb"] = lambda err: (then(err), on_error(err))
    return Consumer(base)


def data_or_skip(msg: Any, who: str, count: Callable[[str], None] | None = None) -> bool:
    """True when ``msg`` carries data. A partition's end is skipped; a fatal error raises
    ``KafkaException``; any other error is logged (as ``who``), counted as ``consumer_errors``
    and skipped."""
    err = msg.error()
    if err is None:
        return True
    from confluent_kafka import KafkaError, KafkaException

    if err.code() == KafkaError._PARTITION_EOF:
        return False
    if err.fatal():
        raise KafkaException(err)
    if count is not None:
        count("consumer_errors")
    log.warning("%s: consumer error: %s", who, err)
    return False


def rewind(consumer: Any, msgs: Iterable[Any]) -> None:
    """Seek each partition of ``msgs`` back to the first of them: they are read again."""
    from confluent_kafka import TopicPartition

    first: dict[tuple[str, int], int] = {}
    for m in msgs:
        if m.error() is None:
            key = (m.topic(), m.partition())
            first[key] = min(first.get(key, m.offset()), m.offset())
    for (topic, partition), offset in first.items():
        consumer.seek(TopicPartition(topic, partition, offset))


class DeadLetters:
    """Dead letters of one stage (``"sink"``, ``"processors"``): produced to ``topic`` with their
    reason, keyed by the source topic, and counted in ``counter`` (and ``metrics``, a
    :class:`~rankscope.metrics.ProcessMetrics`, when given). ``produce`` waits for room in a full
    local queue by serving delivery reports; nothing is dropped."""

    def __init__(self, producer: Any, topic: str, stage: str, counter: DeadLetterCounter, clock: Clock,
                 metrics: Any = None, on_delivery: Callable[[Any, Any], None] | None = None) -> None:
        self.producer = producer
        self.topic = topic
        self.stage = stage
        self.counter = counter
        self.clock = clock
        self.metrics = metrics
        self.on_delivery = on_delivery

    def send(self, topic: str, partition: int, offset: int, reason: str, detail: str, payload: Any) -> None:
        self.counter.add(self.stage, reason)
        if self.metrics is not None:
            self.metrics.dead_letter(self.stage, reason)
        dl = DeadLetter.make(ts_ns=self.clock.wall_ns(), source_topic=topic, partition=partition, offset=offset,
                             stage=self.stage, reason=reason, detail=detail,
                             payload=payload if isinstance(payload, bytes) else None)
        log.debug("%s: dead letter %s[%d]@%d: %s %s", self.stage, topic, partition, offset, reason, detail)
        extra = {"on_delivery": self.on_delivery} if self.on_delivery is not None else {}
        while True:
            try:
                self.producer.produce(self.topic, key=topic.encode(), value=dl.to_json(), **extra)
                break
            except BufferError:   # local queue full: serve delivery reports and try again
                self.producer.poll(0.1)
        self.producer.poll(0)

    def send_for(self, msg: Any, reason: str, detail: str) -> None:
        """The dead letter of a polled message."""
        self.send(msg.topic(), msg.partition(), msg.offset(), reason, detail, msg.value())
