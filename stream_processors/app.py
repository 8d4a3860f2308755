"""The faust-streaming worker: two stages over Kafka, reports, dead letters.

- stage one, :class:`~rankscope.stream_processors.folder.ShardFolder` (steps topic, key = job/rank from v2
  ranks, job from v1 ranks): a consumer thread of its own group folds batches into the shard
  state of the partitions this worker owns and publishes the shard summaries and statistics
  every scan interval. Undecodable input becomes a dead letter with its reason and a counter.
- ``judge`` agent (shards topic, key = job): shard summaries into the
  :class:`~rankscope.stream_processors.stages.JobStage`.
- ``tick`` timer (every scan_interval_s): the job-wide rules; alert changes (JSON) go to the
  alerts topic.
- ``reports`` agent (summaries topic): trace-window summaries into diagnosis reports.
State: none in faust tables. A worker that takes steps partitions rebuilds them from recent input,
and one that takes shards partitions takes back open incidents from the alerts topic
(stream_processors/rebuild.py), before it consumes them. A failing event is logged, counted and skipped; a failing timer tick is logged and
the next tick runs; an error outside them crashes the worker, which exits non-zero for its
supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import json
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
from rankscope.deadletter import DeadLetter, DeadLetterCounter
from rankscope.kafka_client import faust_auth
from rankscope.metrics import process_metrics, start_metrics
from rankscope.stream_processors.folder import ShardFolder
from rankscope.stream_processors.rebuild import open_incidents
from rankscope.stream_processors.report_alerts import ReportAlerts
from rankscope.stream_processors.stages import JobStage, Sender
from rankscope.stream_processors.windows import WindowCollector
from rankscope.topics import Topic
from rankscope.trace_request import TraceRequest, control_body, plan
from rankscope.wire import Envelope, WireError, decode

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
    sender = Sender(socket.gethostname(), os.getpid())
    counter = DeadLetterCounter()
    metrics = process_metrics()
    folder = ShardFolder(settings, f"{app_id(settings)}-shards", clock, counter, sender)
    job_stage = JobStage(settings)
    collector = WindowCollector()
    report_alerts = ReportAlerts()
    auto_traced: dict[str, float] = {}
    app.rankscope_deadletters = counter  # type: ignore[attr-defined]
    app.rankscope_stages = (folder, job_stage)  # type: ignore[attr-defined]

    async def dead_letter(msg: Any, value: Any, reason: str, detail: str) -> None:
        counter.add("processors", reason)
        metrics.dead_letter("processors", reason)
        dl = DeadLetter.make(ts_ns=clock.wall_ns(), source_topic=msg.topic, partition=msg.partition,
                             offset=msg.offset, stage="processors", reason=reason, detail=detail,
                             payload=value if isinstance(value, bytes) else None)
        await topics[Topic.DEADLETTER].send(key=msg.topic.encode(), value=dl.to_json())

    async def decode_or_deadletter(event: Any, kinds: tuple[str, ...]) -> Envelope | None:
        try:
            env = decode(event.value)
            if env.kind not in kinds:
                raise WireError("unexpected_kind", f"{env.kind!r} on {event.message.topic}; expected {list(kinds)}")
            return env
        except WireError as e:
            await dead_letter(event.message, event.value, e.reason, str(e))
        except Exception as e:  # never let one event kill the agent
            counter.add("processors", "internal")
            log.exception("unexpected error decoding event: %s", e)
        return None

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
        loop = asyncio.get_running_loop()
        incidents = await loop.run_in_executor(None, open_incidents, settings, jobs, clock.wall_ns() / 1e9)
        for p, alerts in incidents.items():
            job_stage.restore(p, alerts)
        opened = sum(len(m.incidents) for m in job_stage.monitors.values())
        log.warning("assigned shards partitions %s (%d open incidents)", jobs, opened)

    # Stage one: fold, on its own thread ---------------------------------------------------------
    @app.task
    async def start_folder() -> None:
        folder.start()

        # Stage two: judge ---------------------------------------------------------------------------
    @app.agent(topics[Topic.SHARDS], concurrency=1)
    async def judge(stream: Any) -> None:
        async for event in stream.events():
            metrics.consumed_event(event.message, app, clock.wall_ns())
            env = await decode_or_deadletter(event, ("shard",))
            if env is None:
                continue
            try:
                job_stage.ingest(event.message.partition, env)
            except WireError as e:
                await dead_letter(event.message, event.value, e.reason, str(e))
            except Exception as e:
                counter.add("processors", "apply_failed")
                log.exception("failed to take the shard summary of %s: %s", env.job, e)

    @app.timer(interval=settings.scan_interval_s)
    async def tick() -> None:
        t0 = time.perf_counter()
        now_s = clock.wall_ns() / 1e9
        for alert in job_stage.tick(now_s):
            log.warning("alert %s %s: %s", alert.status, alert.kind, alert.summary)
            try:
                await topics[Topic.ALERTS].send(key=alert.job.encode(), value=alert.to_json())
                if alert.kind == "slow_rank" and alert.status == "open":
                    await auto_trace(alert.job, now_s)
                if alert.kind == "hang" and alert.status == "open":
                    await request_flight_record(alert.job, alert)
            except Exception as e:
                log.exception("publishing alert %s failed: %s", alert.alert_id, e)
        metrics.set_open_incidents(Counter(kind for m in job_stage.monitors.values() for kind in m.incidents))
        metrics.scanned("jobs", time.perf_counter() - t0)

    async def auto_trace(job: str, now_s: float) -> None:
        """A sustained slowdown opens a trace window on the job by itself (rate-limited)."""
        now = clock.monotonic()
        if settings.auto_trace_steps <= 0 or now - auto_traced.get(job, -1e18) < settings.auto_trace_interval_s:
            return
        auto_traced[job] = now
        req = TraceRequest(job=job, steps=settings.auto_trace_steps, reason="auto: slow rank",
                           request_id=f"auto-{job}-{int(now_s)}")
        mon = job_stage.monitors.get(job)
        body = control_body(req, plan(req, mon.progress_rows(now_s, settings) if mon else [], clock.wall_ns()))
        log.warning("auto-trace: opening a %d-step window on job %s", settings.auto_trace_steps, job)
        await topics[Topic.CONTROL].send(key=job.encode(), value=sender.envelope("control", job, body, clock.wall_ns()))

    async def request_flight_record(job: str, alert: Any) -> None:
        """A hang asks every rank for its flight recorder (last steps and all stacks) on the control topic."""
        body = {"command": "flight", "request_id": f"flight-{alert.alert_id}", "ranks": None,
                "args": {"reason": f"alert {alert.alert_id}"}}
        await topics[Topic.CONTROL].send(key=job.encode(), value=sender.envelope("control", job, body, clock.wall_ns()))

    # Reports ------------------------------------------------------------------------------------
    def job_ranks(job: str) -> tuple[list[int] | None, int | None]:
        mon = job_stage.monitors.get(job)
        if mon is None:
            return None, None
        now_s = clock.wall_ns() / 1e9
        return mon.expected_ranks(now_s, settings), mon.world_size(now_s, settings) or None

    async def publish_report(job: str, window_id: str) -> None:
        expected, world = job_ranks(job)
        report = collector.build(job, window_id, expected, world)
        if report is not None:
            log.warning("report %s/%s: slow workers %s", job, window_id, [s["rank"] for s in report["slow_workers"]])
            await topics[Topic.REPORTS].send(key=job.encode(), value=json.dumps(report, default=str).encode())
            for alert in report_alerts.on_report(report, clock.wall_ns()):
                log.warning("alert %s %s: %s", alert.status, alert.kind, alert.summary)
                await topics[Topic.ALERTS].send(key=job.encode(), value=alert.to_json())

    @app.agent(topics[Topic.SUMMARIES], concurrency=1)
    async def reports(stream: Any) -> None:
        async for event in stream.events():
            metrics.consumed_event(event.message, app, clock.wall_ns())
            env = await decode_or_deadletter(event, ("summary",))
            if env is None:
                continue
            try:
                key = collector.add(env, clock.monotonic())
                if collector.complete(key, job_ranks(env.job)[0]):
                    await publish_report(*key)
            except Exception as e:
                counter.add("processors", "report_failed")
                log.exception("report for %s failed: %s", env.job, e)

    @app.timer(interval=2.0)
    async def report_deadlines() -> None:
        for key in collector.overdue(clock.monotonic(), settings.report_deadline_s):
            try:
                await publish_report(*key)
            except Exception as e:
                log.exception("report %s failed: %s", key, e)

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

    app = build_app(settings)
    start_metrics(settings, "processors")
    try:
        # rankscope.logs set up logging (log_format); faust keeps it.
        Worker(app, loglevel=loglevel, quiet=True, override_logging=False).execute_from_commandline()
    finally:
        app.rankscope_stages[0].stop()  # type: ignore[attr-defined]
