"""Prometheus metrics of a rankscope service: the metric definitions and the /metrics server.

Every metric lives in one dedicated :class:`~prometheus_client.CollectorRegistry` per process
(:func:`process_metrics`), never in prometheus-client's global default registry, so a test or a
second library in the same process cannot mix its metrics in. Names are declared once, here:

==========================================  =========  ====================================================
name                                        type       labels, meaning
==========================================  =========  ====================================================
``rankscope_messages_consumed_total``       counter    ``topic``: Kafka messages taken by this process
``rankscope_consumer_lag_messages``         gauge      ``topic``, ``partition``: messages behind the end of
                                                       the partition, after the newest one consumed
``rankscope_consumer_lag_seconds``          gauge      ``topic``, ``partition``: age of the newest message
                                                       consumed (consume time minus its send time)
``rankscope_dead_letters_total``            counter    ``stage``, ``reason``: input routed to the deadletter
                                                       topic
``rankscope_rows_inserted_total``           counter    ``table``: rows written to the store
``rankscope_insert_duration_seconds``       histogram  ``table``: one insert into the store
``rankscope_insert_errors_total``           counter    failed write attempts of a batch (retried)
``rankscope_open_incidents``                gauge      ``kind``: incidents open on this worker's jobs
``rankscope_scan_duration_seconds``         histogram  ``stage`` (``shards``, ``jobs``): one timer tick of the
                                                       rules, publishing included
``rankscope_service_restarts``              gauge      ``service``: restarts by the supervisor before this
                                                       process started
``rankscope_service_info``                  gauge      ``service``, ``version``: always 1
==========================================  =========  ====================================================

plus prometheus-client's ``process_*`` metrics (CPU, memory, open files) of this process.

Updating a metric never raises into the caller's loop and costs a lock and an add; the consumers
call :meth:`Metrics.consumed` once per batch, not per message.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector
from prometheus_client.exposition import start_http_server

from rankscope.config import RESTARTS_ENV, Settings
from rankscope.protocol.alerts import ALERT_KINDS
from rankscope.version import package_version

log = logging.getLogger(__name__)

INSERT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SCAN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """The metric objects of one process, registered in ``registry`` (a new one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.messages = Counter("rankscope_messages_consumed", "Kafka messages consumed by this process.",
                                ["topic"], registry=r)
        self.lag_messages = Gauge("rankscope_consumer_lag_messages",
                                  "Messages behind the end of the partition after the newest one consumed.",
                                  ["topic", "partition"], registry=r)
        self.lag_seconds = Gauge("rankscope_consumer_lag_seconds",
                                 "Age of the newest message consumed: consume time minus its send time.",
                                 ["topic", "partition"], registry=r)
        self.dead_letters = Counter("rankscope_dead_letters", "Input routed to the deadletter topic.",
                                    ["stage", "reason"], registry=r)
        self.rows = Counter("rankscope_rows_inserted", "Rows written to the store.", ["table"], registry=r)
        self.insert_seconds = Histogram("rankscope_insert_duration_seconds", "One insert into the store.",
                                        ["table"], buckets=INSERT_BUCKETS, registry=r)
        self.insert_errors = Counter("rankscope_insert_errors", "Failed write attempts of a batch (retried).",
                                     registry=r)
        self.open_incidents = Gauge("rankscope_open_incidents", "Incidents open on this worker's jobs.",
                                    ["kind"], registry=r)
        self.scan_seconds = Histogram("rankscope_scan_duration_seconds",
                                      "One timer tick of the rules, publishing included.", ["stage"],
                                      buckets=SCAN_BUCKETS, registry=r)
        self.restarts = Gauge("rankscope_service_restarts",
                              "Restarts by the supervisor before this process started.", ["service"], registry=r)
        self.info = Gauge("rankscope_service_info", "The service this process runs; always 1.",
                          ["service", "version"], registry=r)
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        r.register(_GcThresholds())
        self._incident_kinds: set[str] = set(ALERT_KINDS)
        self.server: Any = None   # the /metrics HTTP server, once started

    def stop_server(self) -> None:
        """Stop serving /metrics (services never do; tests and embedders may)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # Consumers ----------------------------------------------------------------------------------
    def consumed(self, msgs: Iterable[Any], consumer: Any, now_ns: int) -> None:
        """Count a batch of confluent-kafka messages by topic and set the lag of each partition in it.

        ``consumer`` supplies the cached high watermarks (no broker round trip); without them only
        the age is set. Messages carrying an error are not counted. Never raises.
        """
        try:
            counts: dict[str, int] = {}
            newest: dict[tuple[str, int], Any] = {}
            for m in msgs:
                if m.error() is not None:
                    continue
                topic = m.topic()
                counts[topic] = counts.get(topic, 0) + 1
                newest[(topic, m.partition())] = m
            for topic, n in counts.items():
                self.messages.labels(topic).inc(n)
            for (topic, partition), m in newest.items():
                kind, ts_ms = m.timestamp()
                high = cached_high(consumer, topic, partition)
                self._lag(topic, partition, now_ns / 1e9 - ts_ms / 1e3 if kind and ts_ms > 0 else None,
                          high - m.offset() - 1 if high >= 0 else None)
        except Exception as e:
            log.debug("metrics: cannot observe a batch: %r", e)

    def consumed_event(self, message: Any, app: Any, now_ns: int) -> None:
        """Count one message of a faust agent and set its partition's lag (``app.consumer`` knows the
        high watermark). Never raises."""
        try:
            self.messages.labels(message.topic).inc()
            try:
                high = int(app.consumer.highwater(message.tp))
            except Exception:
                high = -1
            ts = float(message.timestamp or 0)
            self._lag(message.topic, message.partition, now_ns / 1e9 - ts if ts > 0 else None,
                      high - message.offset - 1 if high >= 0 else None)
        except Exception as e:
            log.debug("metrics: cannot observe an event: %r", e)

    def forget_partitions(self, topic: str, partitions: Iterable[int]) -> None:
        """Drop the lag series of partitions this process no longer owns."""
        for p in partitions:
            for gauge in (self.lag_messages, self.lag_seconds):
                try:
                    gauge.remove(topic, str(p))
                except KeyError:
                    pass

    def _lag(self, topic: str, partition: int, seconds: float | None, messages: int | None) -> None:
        if seconds is not None:
            self.lag_seconds.labels(topic, str(partition)).set(max(0.0, seconds))
        if messages is not None:
            self.lag_messages.labels(topic, str(partition)).set(max(0, messages))

    # Services -----------------------------------------------------------------------------------
    def dead_letter(self, stage: str, reason: str) -> None:
        self.dead_letters.labels(stage, reason).inc()

    def inserted(self, table: str, rows: int, seconds: float) -> None:
        """One successful insert of ``rows`` rows into ``table`` that took ``seconds``."""
        self.rows.labels(table).inc(rows)
        self.insert_seconds.labels(table).observe(seconds)

    def scanned(self, stage: str, seconds: float) -> None:
        self.scan_seconds.labels(stage).observe(seconds)

    def set_open_incidents(self, by_kind: Mapping[str, int]) -> None:
        """Open incidents per alert kind; a kind missing from ``by_kind`` has none."""
        self._incident_kinds.update(by_kind)
        for kind in self._incident_kinds:
            self.open_incidents.labels(kind).set(by_kind.get(kind, 0))


_PROCESS: Metrics | None = None
_PROCESS_LOCK = threading.Lock()


def process_metrics() -> Metrics:
    """The metrics of this process (created on first use, then always the same object)."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            _PROCESS = Metrics()
        return _PROCESS


def start_metrics(settings: Settings, service: str, metrics: Metrics | None = None,
                  environ: Mapping[str, str] | None = None) -> str | None:
    """Serve ``metrics`` (default: :func:`process_metrics`) on ``http://<metrics_host>:<port>/metrics``
    from a daemon thread, the port being the service's ``metrics_port_<service>`` setting.

    Sets the service's info and restart gauges (restarts from ``RANKSCOPE_RESTARTS``, which the
    supervisor passes to its children). Returns the URL, or None when the port setting is 0 or the
    port cannot be bound (one warning; the service runs on without metrics). Does not block.
    """
    m = metrics or process_metrics()
    env = os.environ if environ is None else environ
    try:
        restarts = max(0, int(env.get(RESTARTS_ENV, "0") or 0))
    except ValueError:
        restarts = 0
    m.restarts.labels(service).set(restarts)
    m.info.labels(service, package_version()).set(1)
    url = settings.metrics_url(service)
    if url is None:
        return None
    port = settings.metrics_port(service)
    try:
        m.server, _ = start_http_server(port, addr=settings.metrics_host, registry=m.registry)
    except OSError as e:
        log.warning("metrics: cannot listen on %s:%d (%s); %s runs without /metrics",
                    settings.metrics_host, port, e, service)
        return None
    log.info("metrics on %s", url)
    return url


def cached_high(consumer: Any, topic: str, partition: int) -> int:
    """The partition's high watermark as the consumer last heard it (no broker round trip); -1 when unknown."""
    from confluent_kafka import TopicPartition

    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
    except Exception:
        return -1
    return int(high) if high is not None else -1


class _GcThresholds:
    """``rankscope_gc_threshold{generation}``: the collector's thresholds in this process (the stream
    services raise them, see rankscope/gc_tuning.py), read at each scrape."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("rankscope_gc_threshold", "Python garbage-collector threshold per generation.",
                              labels=["generation"])
        for gen, value in enumerate(gc.get_threshold()):
            g.add_metric([str(gen)], value)
        yield g
