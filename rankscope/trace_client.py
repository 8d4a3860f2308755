"""Open trace windows on a running job and follow the ranks' answers: the one loop that
``rankscope trace`` and the dashboard's Traces page both run; and wait for a window's diagnosis
report as the processors publish it (:func:`wait_for_report`, ``rankscope trace --auto-analyze``).

::

    with WindowRequest(settings, req, sender="cli") as w:
        plan = w.send(progress)                 # planned from the job's progress, delivered or RuntimeError
        for ack in w.acks(time.monotonic() + 20):
            ...                                 # accepted, queued, rejected, done, stopped

The acknowledgement reader is placed at the end of the replies topic before the request goes out,
so no answer is missed. Kafka errors come out as RuntimeError naming the bootstrap address.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from rankscope.config import Settings
from rankscope.consuming import one_off_group, open_consumer
from rankscope.control_io import iter_acks, open_replies_reader
from rankscope.kafka_client import client_conf
from rankscope.topics import Topic
from rankscope.trace_request import Plan, TraceRequest, encode_request, plan

REPORT_CLOCK_SKEW_MS = 60_000   # wait_for_report reads reports published this long before it was asked


@dataclass(frozen=True)
class Ack:
    """One rank's answer to a request: status is accepted, queued, rejected, done or stopped."""

    rank: int
    status: str
    detail: str
    window_id: str = ""
    received_ns: int = 0


class WindowRequest:
    """One request to a job's ranks and the answers to it (a context manager: the reader is closed
    on exit). ``sender`` names who asked (``cli``, ``dashboard``) in the message and the reader's
    group id."""

    def __init__(self, settings: Settings, req: TraceRequest, sender: str, reader_timeout_s: float = 10.0,
                 consumer_factory: Callable[[dict[str, Any]], Any] | None = None,
                 producer_factory: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.settings = settings
        self.req = req
        self.sender = sender
        self.reader_timeout_s = reader_timeout_s
        self._consumer_factory = consumer_factory
        self._producer_factory = producer_factory
        self._consumer: Any = None

    def __enter__(self) -> WindowRequest:
        from confluent_kafka import KafkaException

        try:
            self._consumer = open_replies_reader(self.settings, f"rankscope-{self.sender}-{self.req.request_id}",
                                                 timeout_s=self.reader_timeout_s,
                                                 consumer_factory=self._consumer_factory)
        except KafkaException as e:
            raise RuntimeError(f"Kafka at {self.settings.bootstrap}: {e}") from e
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def send(self, progress: list[dict[str, Any]] | None) -> Plan:
        """Plan the request from the job's progress (per rank: step, ts_ns, median_step_ns; None or
        empty: each rank starts when the request reaches it) and deliver it to the control topic.
        Raises RuntimeError when it is not delivered."""
        from confluent_kafka import KafkaException, Producer

        topic = Topic.CONTROL.name_for(self.settings)
        p = plan(self.req, progress, time.time_ns())
        errors: list[str] = []
        try:
            producer = (self._producer_factory or Producer)(client_conf(self.settings, fatal=True))
            producer.produce(topic, key=self.req.job.encode(), value=encode_request(self.req, p, sender=self.sender),
                             on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
            if producer.flush(10) > 0 or errors:
                raise RuntimeError(f"request not delivered to {topic} at {self.settings.bootstrap}: "
                                   f"{errors[0] if errors else 'timed out'}")
        except KafkaException as e:
            raise RuntimeError(f"Kafka at {self.settings.bootstrap}: {e}") from e
        return p

    def acks(self, deadline: float) -> Iterator[Ack]:
        """The ranks' answers as they come, until the monotonic ``deadline``."""
        if self._consumer is None:
            raise RuntimeError("WindowRequest.acks outside its `with` block")
        for env in iter_acks(self._consumer, self.req.request_id, deadline, job=self.req.job):
            yield Ack(rank=env.rank, status=str(env.body["status"]), detail=str(env.body["detail"]),
                      window_id=str(env.body.get("window_id", "")), received_ns=time.time_ns())


def wait_for_report(settings: Settings, job: str, window_prefix: str, timeout_s: float,
                    since_ns: int) -> dict[str, Any] | None:
    """The newest diagnosis report of ``job`` whose window id starts with ``window_prefix`` that the
    processors published at or after ``since_ns`` (wall clock; e.g. when the request went out),
    waiting up to ``timeout_s``. Read live from the reports topic, from the first message of each
    partition at ``since_ns`` less :data:`REPORT_CLOCK_SKEW_MS` on (the processors' clock may be
    behind this host's), so it needs the processors, not the sink, and rescans nothing older;
    stored reports are read with :func:`rankscope.storage.reports.latest_report`."""
    import json

    from confluent_kafka import OFFSET_END, TopicPartition

    topic = Topic.REPORTS.name_for(settings)
    c = open_consumer(settings, one_off_group("report"), {"enable.auto.commit": False})
    found: dict[str, Any] | None = None
    try:
        meta = c.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise RuntimeError(f"the reports topic {topic} is missing at {settings.bootstrap}; "
                               "create it with: rankscope kafka topics")
        since_ms = max(0, since_ns // 1_000_000 - REPORT_CLOCK_SKEW_MS)
        starts = c.offsets_for_times([TopicPartition(topic, p, since_ms) for p in meta.partitions], timeout=10)
        c.assign([TopicPartition(topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_END) for tp in starts])
        deadline = time.monotonic() + timeout_s
        idle_since = time.monotonic()
        while time.monotonic() < deadline:
            msg = c.poll(0.3)
            if msg is None or msg.error():
                if found is not None and time.monotonic() - idle_since > 1.5:
                    break  # caught up: the newest match is known
                continue
            idle_since = time.monotonic()
            try:
                rep = json.loads(msg.value() or b"")
            except ValueError:
                continue
            if (isinstance(rep, dict) and rep.get("job") == job
                    and str(rep.get("window_id", "")).startswith(window_prefix)):
                found = rep
    finally:
        c.close()
    return found
