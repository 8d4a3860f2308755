"""The faust-streaming worker: two stages over Kafka, reports, dead letters.

- stage one, :class:`~rankscope.stream_processors.shard_loop.ShardLoop` (steps topic, key = job/rank from v2
  ranks, job from v1 ranks): a consumer thread of its own group folds batches into the shard
  state of the partitions this worker owns and publishes the shard summaries and statistics
  every scan interval. Undecodable input becomes a dead letter with its reason and a counter.
- ``judge`` agent (shards topic, key = job), ``tick`` timer (every scan_interval_s), ``reports``
  agent (summaries topic) and a report-deadline timer: each hands its input to
  :class:`~rankscope.stream_processors.handlers.Handlers` (shard summaries into the job stage, the
  job-wide rules and their alerts, trace-window reports) and sends the messages it returns.
State: none in faust tables. A worker that takes steps partitions rebuilds them from recent input,
and one that takes shards partitions takes back open incidents from the alerts topic
(stream_processors/rebuild.py), before it consumes them. A failing event is logged, counted and skipped; a failing timer tick is logged and
the next tick runs; an error outside them crashes the worker, which exits non-zero for its
supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections import Counter
from typing import Any

import faust

from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.config import Settings
from rankscope.kafka_client import faust_auth
from rankscope.metrics import process_metrics, start_metrics
from rankscope.protocol.deadletter import DeadLetterCounter
from rankscope.stream_processors.handlers import Handlers, Out, Source
from rankscope.stream_processors.rebuild import open_incidents
from rankscope.stream_processors.shard_loop import ShardLoop
from rankscope.stream_processors.stages import EnvelopeEncoder, JobStage
from rankscope.topics import Topic

log = logging.getLogger("rankscope.processors")


def app_id(settings: Settings) -> str:
    suffix = settings.topic_prefix.strip(".").replace(".", "-")
    return f"{settings.processors_app_id}-{suffix}" if suffix else settings.processors_app_id


def build_app(settings: Settings, clock: Clock = SYSTEM_CLOCK) -> faust.App:
    app = faust.App(
        app_id(settings),
        broker=f"kafka://{settings.bootstrap}",
        **faust_auth(settings),
        store="memory://",
        topic_partitions=settings.topic_partitions,
        topic_replication_factor=1,
        topic_allow_declare=True,
        broker_session_timeout=6,
        broker_heartbeat_interval=1,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        autodiscover=False,
        datadir=os.path.join(settings.data_dir, "faust"),
        producer_linger_ms=5,
        broker_commit_interval=0.5,   # the committed offset (what lag monitors read) trails the judge by <= 0.5 s
    )
    raw: dict[str, Any] = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    topics = {t: app.topic(t.name_for(settings), partitions=settings.topic_partitions, **raw) for t in Topic}
    names = {t.name_for(settings): t for t in Topic}
    envelopes = EnvelopeEncoder(socket.gethostname(), os.getpid())
    counter = DeadLetterCounter()
    metrics = process_metrics()
    shard_loop = ShardLoop(settings, f"{app_id(settings)}-shards", clock, counter, envelopes)
    job_stage = JobStage(settings)
    handlers = Handlers(settings, clock, job_stage, envelopes, counter,
                        on_dead_letter=lambda reason: metrics.dead_letter("processors", reason))
    app.rankscope_deadletters = counter  # type: ignore[attr-defined]
    app.rankscope_stages = (shard_loop, job_stage)  # type: ignore[attr-defined]

    async def send(outs: list[Out]) -> None:
        for o in outs:
            try:
                await topics[o.topic].send(key=o.key, value=o.value)
            except Exception as e:
                log.exception("sending to %s failed: %s", o.topic.value, e)

    def source(event: Any) -> Source:
        return Source(event.message.topic, event.message.partition, event.message.offset)

    # Partitions come and go ---------------------------------------------------------------------
    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(app: Any, revoked: Any, **kw: Any) -> None:
        job_stage.revoke({tp.partition for tp in revoked if names.get(tp.topic) is Topic.SHARDS})
        for tp in revoked:
            metrics.forget_partitions(tp.topic, [tp.partition])

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def on_assigned(app: Any, assigned: Any, **kw: Any) -> None:
        jobs = sorted({tp.partition for tp in assigned if names.get(tp.topic) is Topic.SHARDS}
                      - set(job_stage.partition_of.values()))
        job_stage.assigning(jobs)
        loop = asyncio.get_running_loop()
        incidents = await loop.run_in_executor(None, open_incidents, settings, jobs, clock.wall_ns() / 1e9)
        for p, alerts in incidents.items():
            job_stage.restore(p, alerts)
        opened = sum(len(m.incidents) for m in job_stage.monitors.values())
        log.warning("assigned shards partitions %s (%d open incidents)", jobs, opened)

    # Stage one: fold, on its own thread ---------------------------------------------------------
    @app.task
    async def start_shard_loop() -> None:
        shard_loop.start()

    # Stage two: judge ---------------------------------------------------------------------------
    @app.agent(topics[Topic.SHARDS], concurrency=1)
    async def judge(stream: Any) -> None:
        async for event in stream.events():
            metrics.consumed_event(event.message, app, clock.wall_ns())
            await send(handlers.on_shard(source(event), event.value))

    @app.timer(interval=settings.scan_interval_s)
    async def tick() -> None:
        t0 = time.perf_counter()
        await send(handlers.on_tick())
        metrics.set_open_incidents(Counter(kind for m in job_stage.monitors.values() for kind in m.incidents))
        metrics.scanned("jobs", time.perf_counter() - t0)

    # Reports ------------------------------------------------------------------------------------
    @app.agent(topics[Topic.SUMMARIES], concurrency=1)
    async def reports(stream: Any) -> None:
        async for event in stream.events():
            metrics.consumed_event(event.message, app, clock.wall_ns())
            await send(handlers.on_summary(source(event), event.value))

    @app.timer(interval=2.0)
    async def report_deadlines() -> None:
        await send(handlers.on_report_deadlines())

    original_crash = app.crash

    async def crash(reason: BaseException) -> None:
        # faust logs "We experienced a crash!" and may linger; a crashed worker must exit so that
        # its supervisor restarts it and the group hands its partitions to the others.
        log.critical("processors worker crashed: %r; exiting for a restart", reason)
        try:
            await original_crash(reason)
        finally:
            sys.stderr.flush()
            os._exit(70)

    app.crash = crash  # type: ignore[method-assign]

    return app


def run_worker(settings: Settings, loglevel: str = "WARNING") -> None:
    """Run the faust worker in this process until SIGTERM/SIGINT (blocks)."""
    from faust.worker import Worker

    from rankscope.gc_tuning import tune_for_streaming

    app = build_app(settings)
    start_metrics(settings, "processors")
    tune_for_streaming()
    try:
        # rankscope.cli.logs set up logging (log_format); faust keeps it.
        Worker(app, loglevel=loglevel, quiet=True, override_logging=False).execute_from_commandline()
    finally:
        app.rankscope_stages[0].stop()  # type: ignore[attr-defined]
