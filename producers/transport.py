"""Rank-side transport: a bounded, non-blocking queue in front of a confluent-kafka producer.

Contract: :meth:`Transport.send` never blocks and never raises; when the queue is full the message
is dropped and counted (the count travels in heartbeats). A background thread moves messages into
librdkafka. With the broker down it logs one warning, keeps buffering up to the bounds (then drops
and counts), and logs once more when deliveries succeed again. After ``fork()`` the child's
transport is inert (DataLoader workers must not touch the parent's producer).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import weakref
from typing import Any

from rankscope.kafka_client import auth_error_cb, failure_kind
from rankscope.producers.untraced import leave_profiler

log = logging.getLogger("rankscope.transport")


_FORKED_HANDLES: list[Any] = []   # in a forked child: the parent's producers, never destroyed


def _after_fork_in_child(ref: weakref.ref[Transport]) -> None:
    transport = ref()
    if transport is not None:
        transport._after_fork_in_child()


class Transport:
    def __init__(self, bootstrap: str, *, queue_max: int = 20000, client_id: str = "rankscope-rank",
                 compression: str = "zstd", producer_config: dict[str, Any] | None = None) -> None:
        self._queue: collections.deque[tuple[str, bytes, bytes]] = collections.deque()
        self._queue_max = queue_max
        self._cond = threading.Condition()
        self._dropped = 0
        self._delivered = 0
        self._failed = 0
        self._broker_down_warned = False
        self._rejected = False
        self._closed = False
        self._pid = os.getpid()
        self._producer: Any = None
        self._thread: threading.Thread | None = None
        try:
            from confluent_kafka import Producer

            conf = {
                "bootstrap.servers": bootstrap,
                "client.id": client_id,
                "linger.ms": 50,
                "compression.type": compression,
                # Java's partitioner, as faust's: a job's job-keyed messages land on the partition
                # number the processors use for that job on every topic.
                "partitioner": "murmur2_random",
                "queue.buffering.max.messages": queue_max,
                "queue.buffering.max.kbytes": 65536,
                "message.timeout.ms": 300000,
                "reconnect.backoff.max.ms": 2000,
                "error_cb": self._on_error,
                # Connection failures reach error_cb, which warns once; librdkafka's own ERR lines
                # would repeat on every reconnect attempt into the training log.
                "logger": logging.getLogger("rankscope.librdkafka"),
                "log_level": 2,
            }
            conf.update(producer_config or {})
            conf["error_cb"] = auth_error_cb(conf, self._on_error)
            self._producer = Producer(conf)
        except Exception as e:  # bad config or missing library: degrade, never fail training
            log.warning("rankscope: Kafka producer unavailable (%s); telemetry disabled", e)
            self._closed = True
            return
        self._thread = threading.Thread(target=self._run, name="rankscope-transport", daemon=True)
        self._thread.start()
        # Held weakly: the interpreter keeps fork handlers for good, and must not keep the transport.
        os.register_at_fork(after_in_child=functools.partial(_after_fork_in_child, weakref.ref(self)))

    # Public ---------------------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def delivered(self) -> int:
        return self._delivered

    def send(self, topic: str, key: bytes, value: bytes) -> bool:
        """Queue one message; returns False (and counts a drop) when full or closed. Never blocks."""
        if self._closed or os.getpid() != self._pid:
            return False
        if len(self._queue) >= self._queue_max:
            self._dropped += 1
            return False
        self._queue.append((topic, key, value))
        if len(self._queue) == 1:
            with self._cond:
                self._cond.notify()
        return True

    def flush(self, timeout_s: float) -> int:
        """Move queued messages to the broker, waiting up to ``timeout_s``. Returns messages left."""
        if self._producer is None or os.getpid() != self._pid:
            return 0
        self._drain()
        try:
            return int(self._producer.flush(timeout_s))
        except Exception:
            return len(self._queue)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        left = self.flush(timeout_s)
        self._closed = True
        with self._cond:
            self._cond.notify()
        if left:
            log.warning("rankscope: %d telemetry messages not delivered at exit", left)
        # Release librdkafka (its threads and broker connections): a closed transport keeps nothing.
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)
        producer, self._producer = self._producer, None
        if producer is not None and left:
            try:
                producer.purge()    # undelivered messages were counted above; destroy does not wait for them
            except Exception:
                pass
        del producer

    # Internals ------------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        self._closed = True
        # The child has the parent's librdkafka memory but none of its threads: destroying that
        # handle here would wait on threads that do not exist. It is kept, unused, for good.
        if self._producer is not None:
            _FORKED_HANDLES.append(self._producer)
        self._producer = None
        self._queue = collections.deque()

    def _run(self) -> None:
        while not self._closed:
            leave_profiler()
            with self._cond:
                if not self._queue:
                    self._cond.wait(0.1)
            self._drain()
            try:
                self._producer.poll(0)
            except Exception:
                pass
            if self._rejected:
                self._give_up()

    def _drain(self) -> None:
        producer = self._producer
        if producer is None:
            return
        while self._queue:
            topic, key, value = self._queue[0]
            try:
                producer.produce(topic, value=value, key=key, on_delivery=self._on_delivery)
            except BufferError:
                # librdkafka's own buffer is full (broker down for long): drop the oldest, count it.
                self._queue.popleft()
                self._dropped += 1
                producer.poll(0)
                continue
            except Exception as e:
                self._queue.popleft()
                self._failed += 1
                log.debug("produce failed: %s", e)
                continue
            self._queue.popleft()

    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is None:
            self._delivered += 1
            if self._broker_down_warned:
                self._broker_down_warned = False
                log.warning("rankscope: Kafka reachable again; telemetry resumed")
        else:
            self._failed += 1

    def _give_up(self) -> None:
        # The broker rejected the credentials (or TLS): reconnecting would repeat that every few
        # hundred ms, so the producer is released and telemetry stays off (reported once).
        self._closed = True
        self._dropped += len(self._queue)
        self._queue.clear()
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.purge()
            except Exception:
                pass
        del producer

    def _on_error(self, err: Any) -> None:
        if self._rejected or failure_kind(err) is not None:
            self._rejected = True
            return
        try:
            from confluent_kafka import KafkaError

            down = err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT)
        except Exception:
            down = True
        if down and not self._broker_down_warned:
            self._broker_down_warned = True
            log.warning("rankscope: Kafka unreachable (%s); training continues, telemetry is buffered "
                        "(bounded) and sent when the broker returns", err)
