"""What the faust worker's agents and timers do, as plain methods that return the messages to send.

stream_processors/app.py wires each to its topic or timer and sends what it returns; here there is
no faust and no Kafka, only an injected clock, so each is unit-tested on its own:

- :meth:`Handlers.on_shard` (the ``judge`` agent): a shard summary into the job stage;
- :meth:`Handlers.on_tick` (the scan timer): the job-wide rules, their alerts, and what an alert
  asks of the ranks (a trace window on a slow rank, rate-limited; step histories and Flight Recorder dumps on a hang);
- :meth:`Handlers.on_summary` (the ``reports`` agent): a trace-window summary into its report,
  published once every expected rank has sent one;
- :meth:`Handlers.on_report_deadlines` (a timer): reports of windows some rank never finished.

Input that does not decode becomes a dead letter with its reason; an error while applying one
event is logged, counted and skipped, so one bad event never stops an agent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rankscope.clock import Clock
from rankscope.config import Settings
from rankscope.protocol.alerts import Alert
from rankscope.protocol.deadletter import DeadLetter, DeadLetterCounter
from rankscope.protocol.envelope import Envelope, decode
from rankscope.protocol.errors import WireError
from rankscope.stream_processors.report_alerts import ReportAlerts
from rankscope.stream_processors.stages import EnvelopeEncoder, JobStage
from rankscope.stream_processors.windows import WindowCollector
from rankscope.topics import Topic
from rankscope.trace_request import TraceRequest, control_body, plan

log = logging.getLogger("rankscope.processors")


@dataclass(frozen=True)
class Source:
    """Where an input event was read: its topic, partition and offset."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class Out:
    """One message to send: topic, key and value."""

    topic: Topic
    key: bytes
    value: bytes


class Handlers:
    def __init__(self, settings: Settings, clock: Clock, job_stage: JobStage, sender: EnvelopeEncoder,
                 counter: DeadLetterCounter, collector: WindowCollector | None = None,
                 report_alerts: ReportAlerts | None = None,
                 on_dead_letter: Callable[[str], None] | None = None) -> None:
        self.settings, self.clock, self.job_stage, self.sender, self.counter = settings, clock, job_stage, sender, counter
        self.on_dead_letter = on_dead_letter    # e.g. the Prometheus counter, by reason
        self.collector = collector or WindowCollector()
        self.report_alerts = report_alerts or ReportAlerts()
        self.auto_traced: dict[str, float] = {}   # job -> monotonic time of its last automatic window

    # Input --------------------------------------------------------------------------------------
    def dead_letter(self, src: Source, value: Any, reason: str, detail: str) -> Out:
        self.counter.add("processors", reason)
        if self.on_dead_letter is not None:
            self.on_dead_letter(reason)
        dl = DeadLetter.make(ts_ns=self.clock.wall_ns(), source_topic=src.topic, partition=src.partition,
                             offset=src.offset, stage="processors", reason=reason, detail=detail,
                             payload=value if isinstance(value, bytes) else None)
        return Out(Topic.DEADLETTER, src.topic.encode(), dl.to_json())

    def decode(self, src: Source, value: Any, kinds: tuple[str, ...], out: list[Out]) -> Envelope | None:
        """The envelope of ``value`` when it decodes to one of ``kinds``; else None, with a dead letter in ``out``."""
        try:
            env = decode(value)
            if env.kind not in kinds:
                raise WireError("unexpected_kind", f"{env.kind!r} on {src.topic}; expected {list(kinds)}")
            return env
        except WireError as e:
            out.append(self.dead_letter(src, value, e.reason, str(e)))
        except Exception as e:  # never let one event kill the agent
            self.counter.add("processors", "internal")
            log.exception("unexpected error decoding event: %s", e)
        return None

    # The judge agent ----------------------------------------------------------------------------
    def on_shard(self, src: Source, value: Any) -> list[Out]:
        out: list[Out] = []
        env = self.decode(src, value, ("shard",), out)
        if env is None:
            return out
        try:
            self.job_stage.ingest(src.partition, env)
        except WireError as e:
            out.append(self.dead_letter(src, value, e.reason, str(e)))
        except Exception as e:
            self.counter.add("processors", "apply_failed")
            log.exception("failed to take the shard summary of %s: %s", env.job, e)
        return out

    # The scan timer -----------------------------------------------------------------------------
    def on_tick(self) -> list[Out]:
        now_s = self.clock.wall_ns() / 1e9
        out: list[Out] = []
        for alert in self.job_stage.tick(now_s):
            log.warning("alert %s %s: %s", alert.status, alert.kind, alert.summary)
            out.append(Out(Topic.ALERTS, alert.job.encode(), alert.to_json()))
            try:
                if alert.kind == "slow_rank" and alert.status == "open":
                    out += self.auto_trace(alert.job, now_s)
                if alert.kind in ("hang", "collective_mismatch") and alert.status == "open":
                    out.append(self.flight_request(alert))
            except Exception as e:
                log.exception("acting on alert %s failed: %s", alert.alert_id, e)
        return out

    def auto_trace(self, job: str, now_s: float) -> list[Out]:
        """A sustained slowdown opens a trace window on the job by itself, at most once per
        ``auto_trace_interval_s`` per job; none when ``auto_trace_steps`` is 0."""
        s = self.settings
        now = self.clock.monotonic()
        if s.auto_trace_steps <= 0 or now - self.auto_traced.get(job, -1e18) < s.auto_trace_interval_s:
            return []
        self.auto_traced[job] = now
        req = TraceRequest(job=job, steps=s.auto_trace_steps, reason="auto: slow rank",
                           request_id=f"auto-{job}-{int(now_s)}")
        mon = self.job_stage.monitors.get(job)
        body = control_body(req, plan(req, mon.progress_rows(now_s, s) if mon else [], self.clock.wall_ns()))
        log.warning("auto-trace: opening a %d-step window on job %s", s.auto_trace_steps, job)
        return [Out(Topic.CONTROL, job.encode(), self.sender.envelope("control", job, body, self.clock.wall_ns()))]

    def flight_request(self, alert: Alert) -> Out:
        """A hang or a mismatched collective asks every rank of its job for its step history (last
        steps and all stacks) and its PyTorch Flight Recorder dump."""
        body = {"command": "flight", "request_id": f"flight-{alert.alert_id}", "ranks": None,
                "args": {"reason": f"alert {alert.alert_id}"}}
        return Out(Topic.CONTROL, alert.job.encode(),
                   self.sender.envelope("control", alert.job, body, self.clock.wall_ns()))

    # Reports ------------------------------------------------------------------------------------
    def job_ranks(self, job: str) -> tuple[list[int] | None, int | None]:
        """(the ranks expected in the job's windows, its world size), both None for a job not seen."""
        mon = self.job_stage.monitors.get(job)
        if mon is None:
            return None, None
        now_s = self.clock.wall_ns() / 1e9
        return mon.expected_ranks(now_s, self.settings), mon.world_size(now_s, self.settings) or None

    def report(self, job: str, window_id: str) -> list[Out]:
        expected, world = self.job_ranks(job)
        report = self.collector.build(job, window_id, expected, world)
        if report is None:
            return []
        log.warning("report %s/%s: slow workers %s", job, window_id, [s["rank"] for s in report["slow_workers"]])
        out = [Out(Topic.REPORTS, job.encode(), json.dumps(report, default=str).encode())]
        for alert in self.report_alerts.on_report(report, self.clock.wall_ns()):
            log.warning("alert %s %s: %s", alert.status, alert.kind, alert.summary)
            out.append(Out(Topic.ALERTS, job.encode(), alert.to_json()))
        return out

    def on_summary(self, src: Source, value: Any) -> list[Out]:
        out: list[Out] = []
        env = self.decode(src, value, ("summary",), out)
        if env is None:
            return out
        try:
            key = self.collector.add(env, self.clock.monotonic())
            if self.collector.complete(key, self.job_ranks(env.job)[0]):
                out += self.report(*key)
        except Exception as e:
            self.counter.add("processors", "report_failed")
            log.exception("report for %s failed: %s", env.job, e)
        return out

    def on_report_deadlines(self) -> list[Out]:
        out: list[Out] = []
        for key in self.collector.overdue(self.clock.monotonic(), self.settings.report_deadline_s):
            try:
                out += self.report(*key)
            except Exception as e:
                log.exception("report %s failed: %s", key, e)
        return out
