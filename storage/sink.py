"""The sink: Kafka -> ClickHouse, committing offsets only after the rows are in the store.

Pipeline per message (snuba's strategy chain, in one thread)::

    poll -> decode/validate -> convert to rows -> batch -> insert all tables -> commit offsets

- Decode: msgpack envelopes (:func:`rankscope.protocol.envelope.decode`) on the steps, stats and hw topics, JSON
  on the alerts (:meth:`Alert.from_json`) and deadletter (:meth:`DeadLetter.from_json`) topics. A
  message that fails is produced to the deadletter topic (``stage="sink"``), counted, and its offset
  is committed with the batch; the sink never stops on bad input.
- Batch: closed at ``settings.sink_batch_rows`` rows or ``settings.sink_batch_s`` seconds after its
  first message (measured on the injected clock), whichever comes first.
- Write: one column-oriented insert per table, then the ``ranks``/``jobs`` upserts, then a flush of
  the dead letters produced for the batch, then a synchronous commit of the exact next offsets.
  A :class:`StoreError` leaves the batch uncommitted: the assignment is paused (the consumer keeps
  polling so it stays in the group) and the same batch is retried with exponential back-off. Tables
  already written are not written again; re-inserts would be harmless anyway (ReplacingMergeTree).
- The ``ranks`` upsert (storage/rank_upserts.py): a rank whose host, process, world size, local rank
  or exit changed is written with the batch that saw it; a rank that only progressed (last step, last
  seen) at most every ``settings.sink_ranks_s``, and on close or revoke. A sink killed with -9 may
  leave a rank's last step and last seen that much behind until the rank's next message.
- Rebalance (eager protocol): on revoke the open batch gets one write attempt; if that fails it is
  dropped uncommitted and whoever owns the partitions next re-reads it.

Converting a message into rows is storage/convert.py (:class:`RowBuilder`, which also keeps the
state of every (job, rank) and job that the ``ranks``/``jobs`` upserts need), over the pure
functions of storage/rows.py; this module is the consumer: batch, write, commit, rebalance. The
first time this process sees a job, the builder's state is filled from the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.config import Settings
from rankscope.consuming import DeadLetters, data_or_skip, open_consumer, rewind
from rankscope.kafka_client import client_conf
from rankscope.metrics import process_metrics
from rankscope.protocol.deadletter import DeadLetterCounter
from rankscope.storage.columns import ARROW_TYPES, JOB_COLUMNS, RANK_COLUMNS, TABLE_ORDER, InvalidMessage
from rankscope.storage.convert import Batch, RowBuilder
from rankscope.storage.rank_upserts import RankUpserts
from rankscope.storage.rows import merge_job, merge_rank
from rankscope.storage.store import Store, StoreError
from rankscope.topics import Topic

log = logging.getLogger(__name__)


class _RepeatFilter(logging.Filter):
    """Drops a line identical to one let through less than ``window_s`` ago (librdkafka repeats
    "connection refused" several times a second while the broker is down)."""

    def __init__(self, window_s: float = 30.0) -> None:
        super().__init__()
        self.window_s = window_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = record.getMessage(), time.monotonic()
        with self._lock:
            seen = self._last.get(key)
            if seen is not None and now - seen < self.window_s:
                return False
            if len(self._last) > 1000:
                self._last.clear()
            self._last[key] = now
        return True


# librdkafka's own log lines, routed into logging (delivered while the client is polled).
_client_log = logging.getLogger("rankscope.kafka.client.sink")
_client_log.addFilter(_RepeatFilter())

STAGE = "sink"
SINK_TOPICS = (Topic.STEPS, Topic.STATS, Topic.ALERTS, Topic.DEADLETTER, Topic.HW, Topic.TRACES, Topic.SUMMARIES,
               Topic.REPORTS, Topic.REPLIES, Topic.CONTROL, Topic.PROFILES)   # CONTROL: step histories from ranks that send them there


@dataclass(frozen=True)
class RetryPolicy:
    """Back-off between write attempts of the same batch: ``initial_s`` doubling up to ``max_s``."""

    initial_s: float = 0.25
    max_s: float = 8.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"RetryPolicy needs 0 < initial_s <= max_s, got {self.initial_s}, {self.max_s}")

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.initial_s * 2 ** max(0, attempt - 1))


def consumer_config(settings: Settings) -> dict[str, Any]:
    """The sink consumer's own settings (over the client settings of :func:`open_consumer`)."""
    return {
        "client.id": "rankscope-sink",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 10000,
        "heartbeat.interval.ms": 2000,
        "max.poll.interval.ms": 300000,
        "topic.metadata.refresh.interval.ms": 10000,  # pick up topics created after start-up
        # Fewer, larger fetches under load (a batch closes after sink_batch_s anyway).
        "fetch.min.bytes": 65536,
        "fetch.wait.max.ms": 100,
        "logger": _client_log,
    }


def producer_config(settings: Settings) -> dict[str, Any]:
    return {**client_conf(settings), "client.id": "rankscope-sink-dlq", "acks": "all",
            "enable.idempotence": True, "linger.ms": 20, "logger": _client_log}


class Sink:
    """Consumes the rankscope topics into the store. One thread drives it (``run`` or ``poll_once``).

    ``consumer``/``producer`` default to confluent-kafka clients built from ``settings``; tests may pass
    objects with the same methods. ``stats()`` may be called from any thread.
    """

    def __init__(self, settings: Settings, store: Store, clock: Clock = SYSTEM_CLOCK, *,
                 consumer: Any = None, producer: Any = None, counter: DeadLetterCounter | None = None,
                 retry: RetryPolicy | None = None, max_poll_messages: int = 1000) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.retry = retry or RetryPolicy()
        self.dead_letters = counter or DeadLetterCounter()
        self.metrics = process_metrics()
        self.max_poll_messages = max_poll_messages
        self.topics = {t: t.name_for(settings) for t in SINK_TOPICS}
        self._kind_by_name = {name: t for t, name in self.topics.items()}
        self._deadletter_topic = Topic.DEADLETTER.name_for(settings)
        if consumer is None:
            consumer = open_consumer(settings, settings.sink_group, consumer_config(settings))
        if producer is None:
            from confluent_kafka import Producer

            producer = Producer(producer_config(settings))
        self._consumer = consumer
        self._producer = producer
        self._consumer.subscribe(list(self.topics.values()), on_assign=self._on_assign,
                                 on_revoke=self._on_revoke)
        self._batch: Batch | None = None      # open batch, still taking messages
        self._pending: Batch | None = None    # closed batch whose write failed, waiting to retry
        self._retry_at = 0.0
        self._paused = False
        self.rows = RowBuilder()
        self._hydrated: set[str] = set()
        self._rank_upserts = RankUpserts(settings.sink_ranks_s)
        self._closed = False
        self._lock = threading.Lock()
        self._rows: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._last_commit: dict[str, Any] = {}
        self._assignment: list[str] = []
        self._dlq_failures = 0
        self._dead_letters = DeadLetters(self._producer, self._deadletter_topic, STAGE, self.dead_letters,
                                         clock, self.metrics, on_delivery=self._on_dlq_delivery)

    # Public interface ---------------------------------------------------------------------------
    def run(self, stop: threading.Event, poll_timeout_s: float = 0.1) -> None:
        """Poll until ``stop`` is set, then write the open batch (one attempt) and close. Blocks."""
        try:
            while not stop.is_set():
                self.poll_once(poll_timeout_s)
        finally:
            self.close()

    def poll_once(self, timeout_s: float = 0.1) -> int:
        """One step: consume up to ``max_poll_messages`` (waiting at most ``timeout_s``), add them to
        the batch, and write the batch when it is full or old enough. While a failed batch waits for
        its retry, only keep the consumer alive. Returns the number of messages taken.

        Raises KafkaException on fatal consumer errors; store errors are retried, never raised.
        """
        if self._pending is not None:
            if self.clock.monotonic() < self._retry_at:
                self._keep_alive(timeout_s)
                return 0
            self._write(self._pending)
            return 0
        msgs = self._consumer.consume(num_messages=self.max_poll_messages, timeout=timeout_s)
        self.metrics.consumed(msgs, self._consumer, self.clock.wall_ns())
        taken = 0
        for i, msg in enumerate(msgs):
            if self._pending is not None:
                # A full batch failed to write mid-call: rewind the rest so that nothing is skipped.
                rewind(self._consumer, msgs[i:])
                break
            if not data_or_skip(msg, STAGE, self._count):
                continue
            self._add(msg)
            taken += 1
            if self._batch is not None and self._batch.rows >= self.settings.sink_batch_rows:
                full, self._batch = self._batch, None
                self._write(full)
        batch = self._batch
        now = self.clock.monotonic()
        if batch is not None and (batch.rows >= self.settings.sink_batch_rows or
                                  now - batch.started_at >= self.settings.sink_batch_s):
            self._batch = None
            self._write(batch)
        elif batch is None and self._pending is None and self._rank_upserts.waiting(now):
            self._write(Batch(started_at=now))   # progress deferred by earlier batches, nothing new since
        return taken

    def stats(self) -> dict[str, Any]:
        """Counters: rows written per table, messages, batches, dead letters, store errors, the last
        commit and the current assignment. Safe from any thread (unlike the consumer itself)."""
        with self._lock:
            counts = {**self._counts, **{f"skipped:{k}": n for k, n in self.rows.skipped.items()}}
            return {"rows": dict(self._rows), "counts": counts,
                    "batches": self._counts["batches"], "messages": self._counts["messages"],
                    "dead_letters": self.dead_letters.total(), "dead_letter_reasons": self.dead_letters.snapshot(),
                    "store_errors": self._counts["store_errors"], "pending_retry": self._pending is not None,
                    "last_commit": dict(self._last_commit), "assignment": list(self._assignment)}

    def close(self) -> None:
        """Write the open batch (one attempt; uncommitted if it fails), flush dead letters and leave the
        group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        batch = self._pending or self._batch
        self._pending = self._batch = None
        self._write_last(batch)
        try:
            left = self._producer.flush(self.settings.flush_timeout_s)
            if left:
                log.error("sink: %d dead letters not delivered on close", left)
            if hasattr(self._producer, "close"):
                self._producer.close()
        except Exception:
            log.exception("sink: flushing dead letters on close failed")
        try:
            self._consumer.close()
        except Exception:
            log.exception("sink: closing the consumer failed")

    # Consuming ----------------------------------------------------------------------------------
    def _add(self, msg: Any) -> None:
        if self._batch is None:
            self._batch = Batch(started_at=self.clock.monotonic())
        batch = self._batch
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        batch.messages += 1
        batch.offsets[(topic, partition)] = max(batch.offsets.get((topic, partition), 0), offset + 1)
        value = msg.value()
        try:
            self.rows.add(self._kind_by_name.get(topic), value, batch)
        except InvalidMessage as e:
            self._dead_letters.send(topic, partition, offset, e.reason, e.detail, value)
            batch.dead_letters += 1

    def _on_dlq_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            self._dlq_failures += 1
            log.error("sink: dead letter not delivered: %s", err)

    # Writing ------------------------------------------------------------------------------------
    def _write_last(self, batch: Batch | None) -> None:
        """One attempt at ``batch`` (when it holds messages) and at the ranks whose write was deferred."""
        if batch is not None and batch.messages:
            self._write(batch, once=True, all_ranks=True)
        elif self._rank_upserts.deferred:
            self._write(Batch(started_at=self.clock.monotonic()), once=True, all_ranks=True)

    def _write(self, batch: Batch, once: bool = False, all_ranks: bool = False) -> bool:
        """Insert every table of ``batch``, then commit its offsets. On failure keep it as pending."""
        batch.attempts += 1
        try:
            self._insert(batch, all_ranks)
            self._flush_dead_letters()
        except StoreError as e:
            self._count("store_errors")
            self.metrics.insert_errors.inc()
            if once:
                log.error("sink: batch of %d messages not written (%s); left uncommitted", batch.messages, e)
                return False
            delay = self.retry.delay(batch.attempts)
            log.error("sink: write attempt %d of a batch of %d rows failed, retrying in %.2fs: %s",
                      batch.attempts, batch.rows, delay, e)
            self._pending = batch
            self._retry_at = self.clock.monotonic() + delay
            self._pause()
            return False
        self._pending = None
        self._resume()
        self._commit(batch)
        return True

    def _insert(self, batch: Batch, all_ranks: bool = False) -> None:
        if batch.jobs - self._hydrated:
            self._hydrate(sorted(batch.jobs - self._hydrated))
        for table in TABLE_ORDER:
            if table in batch.done:
                continue
            if table == "ranks":
                now = self.clock.monotonic()
                keys, due = self._rank_upserts.plan(batch.ranks, batch.urgent_ranks, now, all_ranks)
                rows = [self.rows.ranks[k] for k in keys]
                columns = {c: [r[c] for r in rows] for c in RANK_COLUMNS}
            elif table == "jobs":
                rows = [self.rows.jobs[j] for j in sorted(batch.jobs)]
                columns = {c: [r[c] for r in rows] for c in JOB_COLUMNS}
            elif table in batch.tables:
                columns = batch.tables[table].data
            else:
                continue
            t0 = time.perf_counter()
            n = self.store.insert_columns(table, columns, ARROW_TYPES.get(table))
            self.metrics.inserted(table, n, time.perf_counter() - t0)
            batch.done.add(table)
            if table == "ranks":
                self._rank_upserts.written(batch.ranks, keys, due, now)
            with self._lock:
                self._rows[table] += n

    def _hydrate(self, jobs: list[str]) -> None:
        """Merge what the store already knows about these jobs into the in-memory state (once per job)."""
        db = self.store.database
        params = {"jobs": jobs}
        for row in self.store.query_rows(
                f"SELECT {', '.join(RANK_COLUMNS)} FROM {db}.ranks FINAL WHERE job IN {{jobs:Array(String)}}",
                parameters=params):
            stored = dict(zip(RANK_COLUMNS, row, strict=True))
            key = (stored["job"], stored["rank"])
            if key in self.rows.ranks:
                merge_rank(self.rows.ranks[key], stored)
        for row in self.store.query_rows(
                f"SELECT {', '.join(JOB_COLUMNS)} FROM {db}.jobs FINAL WHERE job IN {{jobs:Array(String)}}",
                parameters=params):
            stored = dict(zip(JOB_COLUMNS, row, strict=True))
            if stored["job"] in self.rows.jobs:
                merge_job(self.rows.jobs[stored["job"]], stored)
        self._hydrated.update(jobs)

    def _flush_dead_letters(self) -> None:
        left = self._producer.flush(self.settings.flush_timeout_s)
        if left:
            raise StoreError(f"{left} dead letters not yet delivered to {self._deadletter_topic}")

    def _commit(self, batch: Batch) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        if not batch.offsets:
            return
        self._count("batches")
        self._count("messages", batch.messages)
        offsets = [TopicPartition(t, p, o) for (t, p), o in sorted(batch.offsets.items())]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:
            # The rows are in the store; a later commit covers these offsets, or a re-read re-inserts
            # the same rows (idempotent).
            self._count("commit_errors")
            log.warning("sink: commit failed (rows are written; may be re-read): %s", e)
            return
        with self._lock:
            self._last_commit = {"ts_ns": self.clock.wall_ns(),
                                 "offsets": {f"{t}[{p}]": o for (t, p), o in sorted(batch.offsets.items())}}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    # Back-pressure and rebalancing ----------------------------------------------------------------
    def _pause(self) -> None:
        if not self._paused:
            self._consumer.pause(self._consumer.assignment())
            self._paused = True

    def _resume(self) -> None:
        if self._paused:
            self._consumer.resume(self._consumer.assignment())
            self._paused = False

    def _keep_alive(self, timeout_s: float) -> None:
        """Serve the group protocol while paused. A message delivered anyway is rewound, not lost."""
        wait = max(0.0, min(timeout_s, self._retry_at - self.clock.monotonic()))
        msg = self._consumer.poll(wait)
        if msg is not None and msg.error() is None:
            from confluent_kafka import TopicPartition

            self._consumer.seek(TopicPartition(msg.topic(), msg.partition(), msg.offset()))

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        log.info("sink: assigned %s", [(p.topic, p.partition) for p in partitions])
        with self._lock:
            self._assignment = sorted(f"{p.topic}[{p.partition}]" for p in partitions)
        if self._paused and partitions:
            consumer.pause(partitions)

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        log.info("sink: revoked %s", [(p.topic, p.partition) for p in partitions])
        for p in partitions:
            self.metrics.forget_partitions(p.topic, [p.partition])
        with self._lock:
            self._assignment = []
        batch = self._pending or self._batch
        self._pending = self._batch = None
        self._write_last(batch)   # dropped uncommitted if it fails; the next owner re-reads it
        self._pending = None
        if self._paused:
            self._paused = False
            try:
                consumer.resume(partitions)
            except Exception:
                pass
