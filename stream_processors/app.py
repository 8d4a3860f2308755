"""The faust-streaming worker: progress agent, hang/death/slow-rank scanner, stats and dead letters.

- ``progress`` agent (concurrency 1) consumes the steps topic (key = job, so one worker sees all
  ranks of a job), folds each message into that job's :class:`JobMonitor` and checkpoints it into
  the ``job-monitors`` table (changelogged, so a restarted worker recovers it). Each event is
  wrapped: undecodable input becomes a dead letter with its reason and a counter; the agent
  never dies on bad input.
- ``scan`` timer (every scan_interval_s) evaluates the rules for the jobs of this worker's
  partitions, publishes alert changes (JSON) on the alerts topic and rolling per-rank stats on
  the stats topic.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

import faust

from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.config import Settings
from rankscope.deadletter import DeadLetter, DeadLetterCounter
from rankscope.topics import Topic
from rankscope.trace_start import START_LEAD_NS, plan_start_step
from rankscope.wire import Envelope, WireError, decode, encode
from stream_processors.monitor import JobMonitor
from stream_processors.report_alerts import ReportAlerts
from stream_processors.windows import WindowCollector

log = logging.getLogger("rankscope.processors")

CHECKPOINT_EVERY_S = 1.0


def app_id(settings: Settings) -> str:
    suffix = settings.topic_prefix.strip(".").replace(".", "-")
    return f"{settings.processors_app_id}-{suffix}" if suffix else settings.processors_app_id


def build_app(settings: Settings, clock: Clock = SYSTEM_CLOCK) -> faust.App:
    app = faust.App(
        app_id(settings),
        broker=f"kafka://{settings.bootstrap}",
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
    )
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    steps_topic = app.topic(Topic.STEPS.name_for(settings), partitions=settings.topic_partitions, **raw)
    alerts_topic = app.topic(Topic.ALERTS.name_for(settings), partitions=settings.topic_partitions, **raw)
    stats_topic = app.topic(Topic.STATS.name_for(settings), partitions=settings.topic_partitions, **raw)
    dead_topic = app.topic(Topic.DEADLETTER.name_for(settings), partitions=settings.topic_partitions, **raw)
    summaries_topic = app.topic(Topic.SUMMARIES.name_for(settings), partitions=settings.topic_partitions, **raw)
    reports_topic = app.topic(Topic.REPORTS.name_for(settings), partitions=settings.topic_partitions, **raw)
    control_topic = app.topic(Topic.CONTROL.name_for(settings), partitions=settings.topic_partitions, **raw)
    collector = WindowCollector()
    report_alerts = ReportAlerts()
    auto_traced: dict[str, float] = {}
    table = app.Table("job-monitors", default=None, partitions=settings.topic_partitions,
                      schema=faust.Schema(key_type=bytes, key_serializer="raw", value_serializer="json"))
    monitors: dict[str, JobMonitor] = {}
    checkpointed: dict[str, float] = {}
    counter = DeadLetterCounter()
    seq = [0]
    host, pid = socket.gethostname(), os.getpid()
    app.rankscope_deadletters = counter  # type: ignore[attr-defined]
    app.rankscope_monitors = monitors  # type: ignore[attr-defined]

    def monitor_for(job: str) -> JobMonitor:
        mon = monitors.get(job)
        if mon is None:
            saved = table.get(job.encode())
            mon = JobMonitor.from_dict(saved) if saved else JobMonitor(job=job)
            monitors[job] = mon
        return mon

    async def decode_or_deadletter(event: Any, kinds: tuple[str, ...]) -> Envelope | None:
        msg = event.message
        try:
            env = decode(event.value)
            if env.kind not in kinds:
                raise WireError("unexpected_kind", f"{env.kind!r} on {msg.topic}; expected {list(kinds)}")
            return env
        except WireError as e:
            counter.add("processors", e.reason)
            dl = DeadLetter.make(ts_ns=clock.wall_ns(), source_topic=msg.topic, partition=msg.partition,
                                 offset=msg.offset, stage="processors", reason=e.reason, detail=str(e),
                                 payload=event.value if isinstance(event.value, bytes) else None)
            await dead_topic.send(key=msg.topic.encode(), value=dl.to_json())
        except Exception as e:  # never let one event kill the agent
            counter.add("processors", "internal")
            log.exception("unexpected error decoding event: %s", e)
        return None

    async def publish_report(job: str, window_id: str) -> None:
        mon = monitors.get(job)
        expected = sorted(r for r, st in mon.ranks.items() if not st.exit_reason) if mon else None
        report = collector.build(job, window_id, expected, mon.world_size if mon else None)
        if report is not None:
            log.warning("report %s/%s: slow workers %s", job, window_id, [s["rank"] for s in report["slow_workers"]])
            await reports_topic.send(key=job.encode(), value=json.dumps(report, default=str).encode())
            for alert in report_alerts.on_report(report, clock.wall_ns()):
                log.warning("alert %s %s: %s", alert.status, alert.kind, alert.summary)
                await alerts_topic.send(key=job.encode(), value=alert.to_json())

    @app.agent(summaries_topic, concurrency=1)
    async def reports(stream: Any) -> None:
        async for event in stream.events():
            env = await decode_or_deadletter(event, ("summary",))
            if env is None:
                continue
            try:
                key = collector.add(env, clock.monotonic())
                mon = monitors.get(env.job)
                if collector.complete(key, mon):
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

    async def auto_trace(job: str) -> None:
        """A sustained slowdown opens a trace window on the job by itself (rate-limited)."""
        now = clock.monotonic()
        if settings.auto_trace_steps <= 0 or now - auto_traced.get(job, -1e18) < settings.auto_trace_interval_s:
            return
        auto_traced[job] = now
        seq[0] += 1
        args: dict[str, Any] = {"steps": settings.auto_trace_steps, "reason": "auto: slow rank"}
        first = plan_start_step(monitor_for(job).progress_rows(), clock.wall_ns(), START_LEAD_NS)
        if first:
            args.update(start_step=first, lead_ns=START_LEAD_NS)   # every rank starts at the same step
        env = Envelope(kind="control", job=job, rank=-1, host=host, pid=pid, seq=seq[0], sent_ns=clock.wall_ns(),
                       body={"command": "trace", "request_id": f"auto{seq[0]}-{int(now)}", "ranks": None,
                             "args": args})
        log.warning("auto-trace: opening a %d-step window on job %s", settings.auto_trace_steps, job)
        await control_topic.send(key=job.encode(), value=encode(env))

    async def request_flight_record(job: str, alert: Any) -> None:
        """A hang asks every rank for its flight recorder (last steps and all stacks) on the control topic."""
        seq[0] += 1
        env = Envelope(kind="control", job=job, rank=-1, host=host, pid=pid, seq=seq[0], sent_ns=clock.wall_ns(),
                       body={"command": "flight", "request_id": f"flight-{alert.alert_id}", "ranks": None,
                             "args": {"reason": f"alert {alert.alert_id}"}})
        await control_topic.send(key=job.encode(), value=encode(env))

    @app.agent(steps_topic, concurrency=1)
    async def progress(stream: Any) -> None:
        async for event in stream.events():
            env = await decode_or_deadletter(event, ("steps", "heartbeat", "exit"))
            if env is None:
                continue
            try:
                mon = monitor_for(env.job)
                mon.apply(env, clock.wall_ns() / 1e9, settings)
                now = clock.monotonic()
                if now - checkpointed.get(env.job, 0.0) >= CHECKPOINT_EVERY_S:
                    checkpointed[env.job] = now
                    table[env.job.encode()] = mon.to_dict()
            except Exception as e:
                counter.add("processors", "apply_failed")
                log.exception("failed to apply %s from %s/%s: %s", env.kind, env.job, env.rank, e)

    @app.timer(interval=settings.scan_interval_s)
    async def scan() -> None:
        now_s = clock.wall_ns() / 1e9
        for key in list(table.keys()):
            job = key.decode() if isinstance(key, bytes) else str(key)
            mon = monitor_for(job)
            try:
                alerts = mon.scan(now_s, settings)
            except Exception as e:
                log.exception("scan of job %s failed: %s", job, e)
                continue
            for alert in alerts:
                log.warning("alert %s %s: %s", alert.status, alert.kind, alert.summary)
                await alerts_topic.send(key=job.encode(), value=alert.to_json())
                if alert.kind == "slow_rank" and alert.status == "open":
                    await auto_trace(job)
                if alert.kind == "hang" and alert.status == "open":
                    await request_flight_record(job, alert)
            if mon.steps_since_stats or alerts:
                mon.steps_since_stats = 0
                seq[0] += 1
                await stats_topic.send(key=job.encode(), value=stats_message(mon, now_s, settings, host, pid, seq[0]))

    return app


def stats_message(mon: JobMonitor, now_s: float, settings: Settings, host: str, pid: int, seq: int) -> bytes:
    import statistics

    states = mon.rank_states(now_s, settings)
    rows = []
    ts_ns = int(now_s * 1e9)
    for r, st in sorted(mon.ranks.items()):
        durs = sorted(st.durations)
        rows.append({
            "rank": r, "ts_ns": ts_ns, "step": st.last_step, "window_steps": len(durs),
            "median_step_ns": int(statistics.median(durs)) if durs else 0,
            "p95_step_ns": int(durs[min(len(durs) - 1, int(0.95 * len(durs)))]) if durs else 0,
            "median_busy_ns": int(statistics.median(st.busy)) if st.busy else 0,
            "median_comm_ns": int(statistics.median(st.comm)) if st.comm else 0,
            "busy_z": round(st.busy_z, 3), "state": states.get(r, "running"),
        })
    env = Envelope(kind="stats", job=mon.job, rank=-1, host=host, pid=pid, seq=seq, sent_ns=time.time_ns(),
                   body={"ranks": rows})
    return encode(env)


def run_worker(settings: Settings, loglevel: str = "WARNING") -> None:
    """Run the faust worker in this process until SIGTERM/SIGINT (blocks)."""
    from faust.worker import Worker

    app = build_app(settings)
    Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
