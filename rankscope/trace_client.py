"""Open trace windows on a running job and follow the ranks' answers: the one loop that
``rankscope trace`` and the dashboard's Traces page both run.

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
from rankscope.control_io import iter_acks, open_replies_reader
from rankscope.kafka_client import client_conf
from rankscope.topics import Topic
from rankscope.trace_request import Plan, TraceRequest, encode_request, plan


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
