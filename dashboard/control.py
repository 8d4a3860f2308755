"""Trace-window requests from the dashboard, and the ranks' acknowledgements.

:func:`request_window` plans and encodes a :class:`~rankscope.trace_request.TraceRequest` the way
``rankscope trace`` does (the same start step and period for the same job progress, read from the
stats topic), sends it to ``Topic.CONTROL`` and collects the ranks' acks from ``Topic.REPLIES``
(kind ``ack``: request_id, status, detail) for a few seconds. No Streamlit here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rankscope.config import Settings
from rankscope.control_io import iter_acks, latest_stats, open_replies_reader
from rankscope.kafka_client import client_conf
from rankscope.topics import Topic
from rankscope.trace_request import MODE_LABELS, MODES, TraceRequest, encode_request, parse_ranks, plan

ACK_WAIT_S = 5.0

__all__ = ["ACK_WAIT_S", "MODES", "MODE_LABELS", "Ack", "TraceRequest", "parse_ranks",
           "request_window"]


@dataclass(frozen=True)
class Ack:
    """One rank's answer to a request: status is accepted, queued, rejected, done or stopped."""

    rank: int
    status: str
    detail: str
    window_id: str = ""
    received_ns: int = 0


def request_window(settings: Settings, req: TraceRequest, wait_s: float = ACK_WAIT_S,
                   expect_ranks: Iterable[int] | None = None, progress: list[dict[str, Any]] | None = None,
                   consumer_factory: Callable[[dict[str, Any]], Any] | None = None,
                   producer_factory: Callable[[dict[str, Any]], Any] | None = None) -> list[Ack]:
    """Send ``req`` to the control topic and return the acks read from the replies topic within ``wait_s`` seconds.

    Blocks for up to ``wait_s`` (plus broker round trips); returns early once every rank of
    ``expect_ranks`` has answered. The ack reader is placed at the end of the topic before the
    request goes out, so no ack is missed. ``progress`` (per rank: step, ts_ns, median_step_ns) plans
    the start step and period; None reads it from the stats topic, as the CLI does. Raises
    RuntimeError when the topic is missing or the request cannot be delivered (confluent_kafka
    errors are wrapped, with the bootstrap address).
    """
    from confluent_kafka import KafkaException, Producer

    topic = Topic.CONTROL.name_for(settings)
    conf = client_conf(settings, fatal=True)
    try:
        consumer = open_replies_reader(settings, f"rankscope-dash-{req.request_id}", timeout_s=5,
                                       consumer_factory=consumer_factory)
    except KafkaException as e:
        raise RuntimeError(f"Kafka at {settings.bootstrap}: {e}") from e
    try:
        try:
            producer = (producer_factory or Producer)(conf)
            errors: list[str] = []
            if progress is None:
                progress = latest_stats(settings, timeout_s=3.0).get(req.job, [])
            value = encode_request(req, plan(req, progress, time.time_ns()), sender="dashboard")
            producer.produce(topic, key=req.job.encode(), value=value,
                             on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
            if producer.flush(5) > 0 or errors:
                raise RuntimeError(f"request not delivered to {topic} at {settings.bootstrap}: "
                                   f"{errors[0] if errors else 'timed out'}")
        except KafkaException as e:
            raise RuntimeError(f"Kafka at {settings.bootstrap}: {e}") from e
        return _collect(consumer, req, wait_s, set(expect_ranks) if expect_ranks is not None else None)
    finally:
        consumer.close()


def _collect(consumer: Any, req: TraceRequest, wait_s: float, expect: set[int] | None) -> list[Ack]:
    acks: list[Ack] = []
    for env in iter_acks(consumer, req.request_id, time.monotonic() + wait_s, job=req.job):
        acks.append(Ack(rank=env.rank, status=str(env.body["status"]), detail=str(env.body["detail"]),
                        window_id=str(env.body.get("window_id", "")), received_ns=time.time_ns()))
        if expect is not None and expect <= {a.rank for a in acks}:
            break
    return acks
