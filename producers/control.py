"""Control channel on the rank: commands from the control topic (acknowledgements go to the replies topic).

A daemon thread reads every partition of the control topic from its end (no consumer group, so
thousands of ranks cost the broker nothing extra), keeps the commands addressed to this job and
rank, and hands them to a handler. Malformed commands are answered with a ``rejected`` ack when
they carry a request id, counted, and dropped; the thread never stops on bad input.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from rankscope.consuming import open_consumer
from rankscope.kafka_client import FirstFailureOnly, failure_kind
from rankscope.producers.untraced import leave_profiler
from rankscope.protocol.envelope import decode
from rankscope.protocol.errors import WireError
from rankscope.protocol.trace import CommandError

log = logging.getLogger("rankscope.control")
_librdkafka_log = logging.getLogger("rankscope.librdkafka")
_librdkafka_log.addFilter(FirstFailureOnly())

COMMANDS = frozenset({"trace", "stop", "flight"})
ACK_STATUSES = frozenset({"accepted", "queued", "rejected", "done", "stopped"})


# A command a rank refuses (rankscope/protocol/trace.py raises it for a trace command's arguments).
ControlError = CommandError


START_MARGIN_MS = 2000


def start_positions(consumer: Any, topic: str, partitions: list[int], since_ms: int) -> list[Any]:
    """Per partition, the first offset of a message produced at or after ``since_ms``, or the end of
    the partition as it was before the lookup when there is none (a message produced after the
    lookup then has an offset past that end, and is read)."""
    from confluent_kafka import TopicPartition

    ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=5.0)[1] for p in partitions}
    found = consumer.offsets_for_times([TopicPartition(topic, p, since_ms) for p in partitions], timeout=5.0)
    return [TopicPartition(topic, tp.partition, tp.offset if tp.offset >= 0 else ends[tp.partition])
            for tp in found]


class ControlListener:
    """Reads commands for (job, rank); calls ``handler(command, request_id, args, ranks, sent_ns)``.

    ``reject(request_id, reason)`` answers malformed commands. ``consumer`` is injectable for tests.
    ``bootstrap`` is an address or a client configuration (rankscope.kafka_client.client_conf); the
    listener stops for good when the broker rejects its credentials.
    """

    def __init__(self, bootstrap: str | Mapping[str, Any], topic: str, job: str, rank: int,
                 handler: Callable[[str, str, dict[str, Any], list[int] | None, int], None],
                 reject: Callable[[str, str], None], consumer: Any = None) -> None:
        self.job, self.rank, self.topic = job, rank, topic
        self._handler, self._reject = handler, reject
        # Commands produced from this time on are read, however late the consumer gets positioned
        # (a rank starved of CPU may take seconds): less a margin for clock skew between hosts.
        self.since_ms = int(time.time() * 1000) - START_MARGIN_MS
        self._stop = threading.Event()
        self.rejected = 0
        self._consumer = consumer
        self._bootstrap = bootstrap
        self._rejected = False   # the broker refused the credentials: the listener stops
        self._thread = threading.Thread(target=self._run, name="rankscope-control", daemon=True)

    def start(self) -> ControlListener:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 0.0) -> None:
        """Ask the thread to end; with ``timeout_s``, wait that long for it (it closes its consumer)."""
        self._stop.set()
        if timeout_s > 0 and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _make_consumer(self) -> Any:
        # A long poll: the broker answers a fetch as soon as a command arrives, so waiting up to 5 s
        # (librdkafka's default is 0.5 s) costs no latency and cuts an idle rank's fetch requests
        # from 2/s to 0.2/s (thousands of ranks poll one control topic).
        base: dict[str, Any] = ({"bootstrap.servers": self._bootstrap} if isinstance(self._bootstrap, str)
                                else dict(self._bootstrap))
        c = open_consumer(base, f"rankscope-rank-{self.job}-{self.rank}",
                          {"enable.auto.commit": False, "auto.offset.reset": "latest", "fetch.wait.max.ms": 5000,
                           "logger": _librdkafka_log, "log_level": 3}, fatal=False, on_error=self._on_error)
        for attempt in range(20):  # 10 s in all; a rejected login ends the wait at once
            try:
                md = c.list_topics(self.topic, timeout=0.5)
                break
            except Exception:
                c.poll(0)  # serves the error callback
                if self._rejected or self._stop.is_set() or attempt == 19:
                    c.close()
                    raise
        parts = md.topics[self.topic].partitions if self.topic in md.topics else {}
        if not parts:
            raise RuntimeError(f"control topic {self.topic} not found")
        c.assign(start_positions(c, self.topic, list(parts), self.since_ms))
        return c

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set() and self._consumer is None:
            try:
                self._consumer = self._make_consumer()
            except Exception as e:
                if self._rejected:
                    return  # reported once by the error callback; the same credentials would fail again
                log.debug("control channel not ready: %s", e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
        while not self._stop.is_set():
            leave_profiler()
            try:
                msg = self._consumer.poll(0.5)
            except Exception as e:
                log.debug("control poll failed: %s", e)
                self._stop.wait(1.0)
                continue
            if self._rejected:
                break
            if msg is None or msg.error():
                continue
            self.handle_payload(msg.value())
        try:
            if self._consumer is not None:
                self._consumer.close()
        except Exception:
            pass

    def _on_error(self, err: Any) -> None:
        if failure_kind(err) is not None:
            self._rejected = True

    def handle_payload(self, payload: bytes | None) -> None:
        """Decode one control message and dispatch it if it is for this rank. Never raises."""
        try:
            env = decode(payload)
            if env.kind in ("ack", "flight"):
                return  # replies that older ranks send on the control topic: not commands
            if env.kind != "control":
                raise WireError("unexpected_kind", f"{env.kind!r} on the control topic; expected ['control']")
        except WireError as e:
            rid = _request_id_of(payload)
            if rid is not None and _job_of(payload) in (self.job, None):
                self.rejected += 1
                self._reject(rid, f"malformed control message: {e}")
            else:
                log.debug("ignoring malformed control message: %s", e)
            return
        if env.job != self.job:
            return
        ranks = env.body["ranks"]
        if ranks is not None and self.rank not in ranks:
            return
        cmd, rid = env.body["command"], env.body["request_id"]
        if cmd not in COMMANDS:
            self.rejected += 1
            self._reject(rid, f"unknown command {cmd!r}; known: {sorted(COMMANDS)}")
            return
        try:
            self._handler(cmd, rid, env.body["args"], ranks, env.sent_ns)
        except ControlError as e:
            self.rejected += 1
            self._reject(rid, str(e))
        except Exception as e:  # the handler must not kill the control thread
            log.warning("rankscope: control command %s failed: %s", cmd, e)
            self._reject(rid, f"internal error: {type(e).__name__}: {e}")


def _loose(payload: bytes | None) -> dict[str, Any] | None:
    try:
        obj = msgpack.unpackb(payload or b"", raw=False, strict_map_key=False)
    except Exception:
        return None
    return obj if isinstance(obj, dict) else None


def _request_id_of(payload: bytes | None) -> str | None:
    obj = _loose(payload)
    if obj is None:
        return None
    body = obj.get("body")
    rid = body.get("request_id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) and rid else None


def _job_of(payload: bytes | None) -> str | None:
    obj = _loose(payload)
    job = obj.get("job") if obj else None
    return job if isinstance(job, str) else None
