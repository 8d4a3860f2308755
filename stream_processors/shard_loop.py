"""Stage one's consumer loop: the steps topic folded in batches on a thread of the worker.

faust's per-event machinery costs about 300 us of CPU per message on this machine (measured with
cProfile: several tasks and futures per event), six times the budget of 50 us per rank per second.
The hot path therefore reads the steps topic with a confluent-kafka consumer of its own group
(``<app id>-shards``): ``consume()`` returns batches decoded in C, the loop decodes and folds them
into the :class:`~rankscope.stream_processors.stages.ShardStage`, and every ``scan_interval_s`` it publishes
the shard summaries and statistics with a confluent-kafka producer (murmur2 partitioner, as faust's,
so a job's summaries land on the partition number of its alerts). The job-wide rules stay faust
agents (stream_processors/app.py).

Contract:
- Partitions assigned to this worker are rebuilt from recent input before they are consumed
  (:func:`~rankscope.stream_processors.rebuild.rebuild_shards`); revoked ones are dropped.
- Offsets are stored after the fold and committed every 250 ms (at least once; folds are idempotent),
  so the committed offset, which lag monitors read, trails the fold by at most that.
- A steps partition whose leader is down (librdkafka's statistics, every second) is judged at the
  newest send time read before, until its ranks delivered again (:meth:`ShardStage.mark_reachable`):
  a broker lost is not a rank lost. When a broker the consumer was connected to is lost, the other
  partitions are held the same way from then: it is one of their in-sync replicas, and they stall
  until the controller drops it. Partitions assigned within the hold's bound after such a loss (the
  group rebalances when its coordinator was on the lost broker) are held from what their rebuild read.
- The profiles partitions of the same numbers (same key, job/rank) are read beside them, from
  PROFILE_LOOKBACK_S before the assignment, by a consumer of their own that commits nothing: only a
  rank's newest profile interval matters (stream_processors/profile_digest.py).
- A bad message becomes a dead letter with its reason and is counted; an error in one fold is
  logged and counted. Anything else ends the process (exit code 70) for its supervisor to restart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

from confluent_kafka import Producer, TopicPartition

from rankscope.clock import Clock
from rankscope.config import Settings
from rankscope.consuming import DeadLetters, open_consumer
from rankscope.kafka_client import client_conf
from rankscope.metrics import cached_high, process_metrics
from rankscope.protocol.deadletter import DeadLetterCounter
from rankscope.protocol.envelope import decode
from rankscope.protocol.errors import WireError
from rankscope.stream_processors.rebuild import rebuild_shards
from rankscope.stream_processors.stages import RECOVERY_FACTOR, STEPS_KINDS, EnvelopeEncoder, ShardStage
from rankscope.topics import Topic

log = logging.getLogger("rankscope.processors")

STATS_INTERVAL_MS = 1000   # librdkafka statistics: which partitions' leaders are down
PROFILE_LOOKBACK_S = 60.0
PROFILE_BATCH = 64


class ShardLoop:
    def __init__(self, settings: Settings, group_id: str, clock: Clock, counter: DeadLetterCounter,
                 sender: EnvelopeEncoder) -> None:
        self.settings = settings
        self.group_id = group_id
        self.clock = clock
        self.counter = counter
        self.metrics = process_metrics()
        self.stage = ShardStage(settings, sender)
        self.folded = 0
        self.assigned: set[int] = set()
        self._up_brokers: set[int] = set()   # the brokers connected at the last statistics
        self._broker_lost_s: float | None = None   # when a connected broker was last lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._topic = Topic.STEPS.name_for(settings)
        self._profiles_topic = Topic.PROFILES.name_for(settings)
        self._names = {t: t.name_for(settings) for t in Topic}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_or_exit, name="rankscope-shards", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # The loop ---------------------------------------------------------------------------------
    def _run_or_exit(self) -> None:
        try:
            self.run()
        except Exception as e:
            log.critical("the shard consumer failed: %r; exiting for a restart", e, exc_info=True)
            os._exit(70)

    def run(self) -> None:
        s = self.settings
        self.consumer = open_consumer(s, self.group_id, {
            "auto.offset.reset": "earliest",
            "enable.auto.commit": True, "enable.auto.offset.store": False, "auto.commit.interval.ms": 250,
            "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000, "fetch.wait.max.ms": 100,
            "partition.assignment.strategy": "cooperative-sticky",
            "statistics.interval.ms": STATS_INTERVAL_MS, "stats_cb": self._on_stats,
            "logger": log, "log_level": 3})
        self.producer = Producer({**client_conf(s, fatal=True), "linger.ms": 5, "compression.type": "lz4",
                                  "partitioner": "murmur2_random", "logger": log, "log_level": 3})
        self.dead_letters = DeadLetters(self.producer, self._names[Topic.DEADLETTER], "processors", self.counter,
                                        self.clock, self.metrics)
        self.profiles_consumer = open_consumer(s, f"{self.group_id}-profiles", {"enable.auto.commit": False,
            "auto.offset.reset": "latest", "fetch.wait.max.ms": 100, "logger": log, "log_level": 3})
        self.consumer.subscribe([self._topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_revoke)
        next_tick = self.clock.monotonic() + s.scan_interval_s
        try:
            while not self._stop.is_set():
                wait = max(0.0, min(0.2, next_tick - self.clock.monotonic()))
                msgs = self.consumer.consume(s.processors_batch, timeout=wait)
                if msgs:
                    self.fold(msgs)
                profiles = self.profiles_consumer.consume(PROFILE_BATCH, timeout=0)
                if profiles:
                    self.fold_profiles(profiles)
                if self.clock.monotonic() >= next_tick:
                    next_tick = self.clock.monotonic() + s.scan_interval_s
                    t0 = time.perf_counter()
                    self.tick()
                    self.metrics.scanned("shards", time.perf_counter() - t0)
                self.producer.poll(0)
        finally:
            self.consumer.close()
            self.profiles_consumer.close()
            self.producer.flush(5)

    def fold(self, msgs: list[Any]) -> None:
        self.metrics.consumed(msgs, getattr(self, "consumer", None), self.clock.wall_ns())
        now_s = self.clock.wall_ns() / 1e9
        last: dict[int, Any] = {}
        for m in msgs:
            if m.error():
                continue
            last[m.partition()] = m
            try:
                env = decode(m.value())
                if env.kind not in STEPS_KINDS:
                    raise WireError("unexpected_kind", f"{env.kind!r} on {m.topic()}; expected {list(STEPS_KINDS)}")
            except WireError as e:
                self.dead_letters.send_for(m, e.reason, str(e))
                continue
            try:
                self.stage.ingest(m.partition(), env, now_s)
                self.folded += 1
            except Exception as e:
                self.counter.add("processors", "apply_failed")
                log.exception("failed to apply %s from %s/%s: %s", env.kind, env.job, env.rank, e)
        for m in last.values():
            self.consumer.store_offsets(message=m)
            high = cached_high(self.consumer, m.topic(), m.partition())
            self.stage.mark_read(m.partition(), high > m.offset() + 1)

    def fold_profiles(self, msgs: list[Any]) -> None:
        for m in msgs:
            if m.error():
                continue
            try:
                env = decode(m.value())
                if env.kind != "profile":
                    raise WireError("unexpected_kind", f"{env.kind!r} on {m.topic()}; expected ['profile']")
            except WireError as e:
                self.dead_letters.send_for(m, e.reason, str(e))
                continue
            try:
                self.stage.ingest_profile(m.partition(), env)
            except Exception as e:
                self.counter.add("processors", "apply_failed")
                log.exception("failed to digest the profile of %s/%s: %s", env.job, env.rank, e)

    def tick(self) -> None:
        for topic, key, value in self.stage.tick(self.clock.wall_ns() / 1e9):
            self._produce(self._names[topic], key, value)

    def _produce(self, topic: str, key: bytes, value: bytes) -> None:
        try:
            self.producer.produce(topic, key=key, value=value)
        except BufferError:
            self.producer.poll(1.0)
            self.producer.produce(topic, key=key, value=value)

    def _on_stats(self, stats_json: str) -> None:
        """librdkafka's statistics (inside consume(), on this thread): the steps partitions whose
        leader is down go to the stage, which judges their ranks' silence accordingly."""
        try:
            stats = json.loads(stats_json)
            down = unreachable_partitions(stats, self._topic) & self.assigned
            up = up_brokers(stats)
        except (ValueError, TypeError, AttributeError) as e:
            log.debug("unreadable consumer statistics: %s", e)
            return
        if down != self.stage.unreachable:
            log.warning("steps partitions without a reachable leader: %s", sorted(down) or "none")
        lost = self._up_brokers - up
        stalled = self.assigned - down if lost else set()
        if stalled:
            log.warning("brokers %s lost: steps partitions %s are judged at what was read from them until "
                        "their ranks deliver again", sorted(lost), sorted(stalled))
        self._up_brokers = up
        now_s = self.clock.wall_ns() / 1e9
        if lost:
            self._broker_lost_s = now_s
        self.stage.mark_reachable(down, now_s, stalled)

    # Rebalance callbacks (run inside consume(), on this thread) ---------------------------------
    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        new = sorted({tp.partition for tp in partitions} - self.assigned)
        self.assigned |= set(new)
        now_s = self.clock.wall_ns() / 1e9
        rebuilt = rebuild_shards(self.settings, new, now_s)
        self.stage.install(rebuilt)
        log.warning("assigned steps partitions %s (%d shard jobs rebuilt)", new, len(rebuilt))
        if new and self.broker_lost_recently(now_s):
            # The lost broker may still stall them: their ranks are judged at what the rebuild read.
            log.warning("a broker was lost %.0f s ago: steps partitions %s are judged at what was read from "
                        "them until their ranks deliver again", now_s - (self._broker_lost_s or now_s), new)
            self.stage.mark_reachable(set(self.stage.unreachable), now_s, stalled=set(new))
        self._assign_profiles(new)

    def broker_lost_recently(self, now_s: float) -> bool:
        """Was a connected broker lost within the longest hold (RECOVERY_FACTOR x dead_after_s)?"""
        return (self._broker_lost_s is not None
                and now_s - self._broker_lost_s < RECOVERY_FACTOR * self.settings.dead_after_s)

    def _assign_profiles(self, partitions: list[int]) -> None:
        """Read the profiles partitions of these numbers from PROFILE_LOOKBACK_S ago."""
        if not partitions:
            return
        since_ms = int(self.clock.wall_ns() / 1e6 - PROFILE_LOOKBACK_S * 1000)
        wanted = [TopicPartition(self._profiles_topic, p, since_ms) for p in partitions]
        try:
            starts = self.profiles_consumer.offsets_for_times(wanted, timeout=10)
        except Exception as e:    # the profiles topic missing or slow to answer: read from its end
            log.warning("profiles partitions %s start at their end: %s", partitions, e)
            starts = [TopicPartition(self._profiles_topic, p, -1) for p in partitions]
        self.profiles_consumer.incremental_assign(starts)

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        gone = {tp.partition for tp in partitions}
        self.assigned -= gone
        self.stage.revoke(gone)
        self.metrics.forget_partitions(self._topic, gone)
        with contextlib.suppress(Exception):   # partitions never assigned there
            self.profiles_consumer.incremental_unassign([TopicPartition(self._profiles_topic, p) for p in gone])
        log.warning("revoked steps partitions %s", sorted(gone))


def up_brokers(stats: dict[str, Any]) -> set[int]:
    """The brokers a client is connected to, from its librdkafka statistics: one connected at the
    last statistics and not now is lost (a connection being set up, or never needed, is no loss)."""
    return {b["nodeid"] for b in stats.get("brokers", {}).values()
            if b.get("nodeid", -1) >= 0 and b.get("state") == "UP"}


def unreachable_partitions(stats: dict[str, Any], topic: str) -> set[int]:
    """The partitions of ``topic`` in a consumer's librdkafka statistics whose leader is unknown or
    not connected (its broker's state is not ``UP``)."""
    up = {b.get("nodeid") for b in stats.get("brokers", {}).values() if b.get("state") == "UP"}
    out = set()
    for key, part in stats.get("topics", {}).get(topic, {}).get("partitions", {}).items():
        p = int(key)
        if p < 0:       # librdkafka's unassigned-partition entry
            continue
        leader = part.get("leader", -1)
        if leader is None or leader < 0 or leader not in up:
            out.add(p)
    return out
