"""The alerts topic -> a webhook, each alert version once: the loop of ``rankscope alerts --webhook``.

For each message, in partition order (:meth:`Forwarder.handle`, then :func:`forward`):

1. decode it (``Alert.from_json``); a malformed one is logged and counted (``malformed``);
2. skip it when ``--job`` names another job (``other_job``), when its version was updated longer
   than ``max_age_s`` ago (``stale``: a first start does not replay the topic's history), or when
   this process already delivered its ``(alert_id, version)`` (``duplicate``: the same message read
   again after a rebalance);
3. render it (webhook_formats) and deliver it (webhook_delivery); ``delivered``, or ``rejected`` /
   ``gave_up``, logged and counted;
4. commit the message's offset, synchronously, unless the delivery was cut short by a stop.

Offsets are committed only after their alert was delivered or given up, so a forwarder that stops
(SIGTERM finishes the current alert first) or restarts goes on after the last alert it finished:
each version reaches the webhook once. Only a forwarder killed between a POST and its commit sends
that one version again when it restarts.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any, Literal, Protocol

from rankscope.cli.commands.webhook_delivery import (
    DELIVERED,
    STOPPED,
    RetryPolicy,
    Sender,
    Wait,
    deliver,
    post_json,
    sleep,
)
from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.protocol.alerts import Alert

log = logging.getLogger("rankscope.alerts.webhook")

SKIPPED_MALFORMED, SKIPPED_OTHER_JOB, SKIPPED_STALE, SKIPPED_DUPLICATE = "malformed", "other_job", "stale", "duplicate"


class RecentDeliveries:
    """The ``(alert_id, version)`` pairs delivered lately: at most ``capacity``, oldest forgotten first."""

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[tuple[str, int], None] = OrderedDict()

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._keys

    def add(self, key: tuple[str, int]) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


class Forwarder:
    """Steps 1-3 for one message value; :attr:`counts` counts every outcome by name."""

    def __init__(self, url: str, render: Callable[[Alert], dict[str, Any]], policy: RetryPolicy, *,
                 job: str = "", max_age_s: float = 0.0, send: Sender = post_json, wait: Wait = sleep,
                 clock: Clock = SYSTEM_CLOCK, recent: RecentDeliveries | None = None) -> None:
        self.url, self.render, self.policy = url, render, policy
        self.job, self.max_age_s = job, max_age_s
        self.send, self.wait, self.clock = send, wait, clock
        self.recent = recent if recent is not None else RecentDeliveries()
        self.counts: Counter[str] = Counter()

    def handle(self, value: bytes) -> str:
        """The outcome for one message value: a delivery outcome or a reason it was skipped. Blocks
        while it delivers (at most ``policy.worst_case_s()``)."""
        outcome = self._handle(value)
        self.counts[outcome] += 1
        return outcome

    def _handle(self, value: bytes) -> str:
        try:
            alert = Alert.from_json(value)
        except ValueError as e:
            log.warning("skipping a malformed alert: %s", e)
            return SKIPPED_MALFORMED
        if self.job and alert.job != self.job:
            return SKIPPED_OTHER_JOB
        if self.max_age_s > 0 and self.clock.wall_ns() - alert.updated_ns > self.max_age_s * 1e9:
            return SKIPPED_STALE
        key = (alert.alert_id, alert.version)
        if key in self.recent:
            return SKIPPED_DUPLICATE
        body = json.dumps(self.render(alert)).encode()
        result = deliver(self.url, body, self.policy, self.send, self.wait)
        if result.outcome == STOPPED:
            return STOPPED
        self.recent.add(key)     # given up or rejected counts too: it is not sent again
        if result.outcome == DELIVERED:
            log.info("delivered %s %s v%d (%s)", alert.kind, alert.alert_id, alert.version, alert.status)
        else:
            log.warning("%s %s v%d not delivered (%s after %d attempts: %s); skipping it", alert.kind,
                        alert.alert_id, alert.version, result.outcome, result.attempts, result.error)
        return result.outcome


class AlertSource(Protocol):
    """What :func:`forward` needs of a confluent-kafka Consumer."""

    def poll(self, timeout: float) -> Any: ...

    def commit(self, *, message: Any, asynchronous: Literal[False]) -> Any: ...


def forward(consumer: AlertSource, forwarder: Forwarder, stop: threading.Event, poll_s: float = 0.5) -> None:
    """Read, deliver and commit (module docstring) until ``stop`` is set. A failed commit is logged:
    the alert may be read again after a restart."""
    while not stop.is_set():
        msg = consumer.poll(poll_s)
        if msg is None:
            continue
        if msg.error():
            log.warning("alerts topic: %s", msg.error())
            continue
        if forwarder.handle(msg.value() or b"") == STOPPED:
            return
        try:
            consumer.commit(message=msg, asynchronous=False)
        except Exception as e:   # KafkaException: a rebalance took the partition, or no coordinator
            forwarder.counts["commit_failed"] += 1
            log.warning("could not commit offset %d of partition %d: %s", msg.offset(), msg.partition(), e)
