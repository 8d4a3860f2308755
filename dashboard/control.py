"""Trace-window requests from the dashboard: the same control message as ``rankscope trace``, and its acks.

:class:`WindowRequest` is validated up front; :func:`encode` builds the message with the CLI's own
``build_request``, so the dashboard and the CLI cannot drift apart. :func:`request_window` sends it
to ``Topic.CONTROL`` and collects the ranks' acknowledgements from ``Topic.REPLIES`` (kind ``ack``:
request_id, status, detail) for a few seconds. No Streamlit here.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rankscope.commands.trace import build_request, iter_acks, open_replies_reader, parse_ranks
from rankscope.config import Settings
from rankscope.kafka_client import client_conf
from rankscope.topics import Topic

MODES = ("once", "every_s", "every_steps", "continuous")
MODE_LABELS = {"once": "once", "every_s": "every N seconds", "every_steps": "every K steps",
               "continuous": "continuous (until stopped)"}
ACK_WAIT_S = 5.0

__all__ = ["ACK_WAIT_S", "MODES", "MODE_LABELS", "Ack", "WindowRequest", "encode", "parse_ranks",
           "request_window"]


@dataclass(frozen=True)
class WindowRequest:
    """A trace-window request (or, with ``stop``, a stop of running windows and schedules).

    ``ranks`` None means every rank. ``mode`` is one of :data:`MODES`; ``every_s`` / ``every_steps``
    are used by their mode only. Raises ValueError naming the bad value and its allowed range.
    """

    job: str
    ranks: list[int] | None = None
    steps: int = 3
    mode: str = "once"
    every_s: float = 0.0
    every_steps: int = 0
    with_stack: bool = True
    with_shapes: bool = False
    byte_budget: int = 0
    stop: bool = False
    request_id: str = field(default_factory=lambda: f"tw{uuid.uuid4().hex[:8]}")

    def __post_init__(self) -> None:
        if not self.job:
            raise ValueError("job must not be empty")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.ranks is not None and (not self.ranks or min(self.ranks) < 0):
            raise ValueError(f"ranks must be None (all) or non-negative ranks, got {self.ranks!r}")
        if self.stop:
            return
        if not 1 <= self.steps <= 10_000:
            raise ValueError(f"steps must be in [1, 10000], got {self.steps}")
        if self.mode == "every_s" and not 0 < self.every_s <= 7 * 86400:
            raise ValueError(f"every N seconds needs N in (0, 604800], got {self.every_s}")
        if self.mode == "every_steps" and not self.steps <= self.every_steps <= 10_000_000:
            raise ValueError(f"every K steps needs K in [steps={self.steps}, 10000000], got {self.every_steps}")
        if self.byte_budget < 0:
            raise ValueError(f"byte_budget must be >= 0, got {self.byte_budget}")

    def cli_args(self) -> argparse.Namespace:
        """The request as ``rankscope trace`` arguments (what ``build_request`` reads)."""
        return argparse.Namespace(
            stop=self.stop, steps=self.steps, shapes=self.with_shapes, no_stack=not self.with_stack,
            byte_budget=self.byte_budget, every=f"{self.every_s:g}s" if self.mode == "every_s" else "",
            every_steps=self.every_steps if self.mode == "every_steps" else 0,
            continuous=self.mode == "continuous")


def encode(req: WindowRequest) -> bytes:
    """The control message for ``req`` (msgpack envelope, kind ``control``)."""
    return build_request(req.cli_args(), req.ranks, req.request_id, req.job)


@dataclass(frozen=True)
class Ack:
    """One rank's answer to a request: status is accepted, queued, rejected, done or stopped."""

    rank: int
    status: str
    detail: str
    window_id: str = ""
    received_ns: int = 0


def request_window(settings: Settings, req: WindowRequest, wait_s: float = ACK_WAIT_S,
                   expect_ranks: Iterable[int] | None = None,
                   consumer_factory: Callable[[dict[str, Any]], Any] | None = None,
                   producer_factory: Callable[[dict[str, Any]], Any] | None = None) -> list[Ack]:
    """Send ``req`` to the control topic and return the acks read from the replies topic within ``wait_s`` seconds.

    Blocks for up to ``wait_s`` (plus broker round trips); returns early once every rank of
    ``expect_ranks`` has answered. The ack reader is placed at the end of the topic before the
    request goes out, so no ack is missed. Raises RuntimeError when the topic is missing or the
    request cannot be delivered (confluent_kafka errors are wrapped, with the bootstrap address).
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
            producer.produce(topic, key=req.job.encode(), value=encode(req),
                             on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
            if producer.flush(5) > 0 or errors:
                raise RuntimeError(f"request not delivered to {topic} at {settings.bootstrap}: "
                                   f"{errors[0] if errors else 'timed out'}")
        except KafkaException as e:
            raise RuntimeError(f"Kafka at {settings.bootstrap}: {e}") from e
        return _collect(consumer, req, wait_s, set(expect_ranks) if expect_ranks is not None else None)
    finally:
        consumer.close()


def _collect(consumer: Any, req: WindowRequest, wait_s: float, expect: set[int] | None) -> list[Ack]:
    acks: list[Ack] = []
    for env in iter_acks(consumer, req.request_id, time.monotonic() + wait_s, job=req.job):
        acks.append(Ack(rank=env.rank, status=str(env.body["status"]), detail=str(env.body["detail"]),
                        window_id=str(env.body.get("window_id", "")), received_ns=time.time_ns()))
        if expect is not None and expect <= {a.rank for a in acks}:
            break
    return acks
