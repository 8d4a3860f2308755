"""The processors' two stages as plain objects with explicit state; the faust app only wires them.

- :class:`ShardStage` owns the steps partitions assigned to this worker: one
  :class:`~rankscope.stream_processors.shard.ShardJob` per (partition, job). Each tick it emits every
  shard's bounded summary (``shards`` topic, key = job) and the rolling per-rank statistics.
- :class:`JobStage` owns the ``shards`` partitions assigned to this worker, i.e. the jobs they
  carry (key = job): one :class:`~rankscope.stream_processors.monitor.JobMonitor` per job. Each tick it
  evaluates the job-wide rules and returns the alerts to publish.
Neither does I/O: ticks return ``(topic, key, value)`` messages or alerts, and time comes in.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

from rankscope.alerts import Alert
from rankscope.config import Settings
from rankscope.stream_processors.monitor import JobMonitor
from rankscope.stream_processors.shard import ShardJob
from rankscope.stream_processors.summary import ShardSummary
from rankscope.topics import Topic
from rankscope.wire import Envelope, encode

log = logging.getLogger("rankscope.processors")

Message = tuple[Topic, bytes, bytes]
STEPS_KINDS = ("beat", "steps", "heartbeat", "exit")


class Sender:
    """The envelope fields of what this worker publishes, with its own sequence numbers."""

    def __init__(self, host: str, pid: int) -> None:
        self.host, self.pid = host, pid
        self._seq = itertools.count(1)

    def envelope(self, kind: str, job: str, body: dict, sent_ns: int) -> bytes:
        return encode(Envelope(kind=kind, job=job, rank=-1, host=self.host, pid=self.pid, seq=next(self._seq),
                               sent_ns=sent_ns, body=body))


class ShardStage:
    def __init__(self, settings: Settings, sender: Sender) -> None:
        self.settings = settings
        self.sender = sender
        self.shards: dict[tuple[int, str], ShardJob] = {}

    def ingest(self, partition: int, env: Envelope, now_s: float) -> None:
        key = (partition, env.job)
        sj = self.shards.get(key)
        if sj is None:
            sj = self.shards[key] = ShardJob(env.job, partition)
        sj.apply(env, now_s, self.settings)

    def install(self, rebuilt: Iterable[ShardJob]) -> None:
        """Take the state rebuilt from recent input for newly assigned partitions."""
        for sj in rebuilt:
            self.shards[(sj.shard, sj.job)] = sj

    def revoke(self, partitions: set[int]) -> None:
        for key in [k for k in self.shards if k[0] in partitions]:
            del self.shards[key]

    def tick(self, now_s: float) -> list[Message]:
        """Every shard's summary and statistics; jobs idle for ``job_idle_s`` are retired."""
        out: list[Message] = []
        now_ns = int(now_s * 1e9)
        for key, sj in list(self.shards.items()):
            newest = max((st.hb_s for st in sj.ranks.values()), default=sj.last_input_s)
            retired = now_s - newest > self.settings.job_idle_s
            summary = sj.summary(now_s, self.settings, retired=retired)
            out.append((Topic.SHARDS, sj.job.encode(), self.sender.envelope("shard", sj.job, summary.to_body(), now_ns)))
            if retired:
                del self.shards[key]
                continue
            if summary.agg["new_steps"] or summary.agg["silent"]:
                for rows in sj.stats_chunks(now_s, self.settings):
                    out.append((Topic.STATS, sj.job.encode(), self.sender.envelope("stats", sj.job, {"ranks": rows}, now_ns)))
        return out


class JobStage:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.monitors: dict[str, JobMonitor] = {}
        self.partition_of: dict[str, int] = {}

    def monitor(self, job: str, partition: int) -> JobMonitor:
        mon = self.monitors.get(job)
        if mon is None:
            mon = self.monitors[job] = JobMonitor(job=job)
        self.partition_of[job] = partition
        return mon

    def ingest(self, partition: int, env: Envelope) -> None:
        """Keep one shard summary (raises WireError when its body is invalid)."""
        self.monitor(env.job, partition).add_summary(ShardSummary.from_body(env.body))

    def restore(self, partition: int, alerts: Iterable[Alert]) -> None:
        """Open incidents read back from the alerts topic (in publication order) keep their ids."""
        for alert in alerts:
            if alert.kind in ("hang", "dead_rank", "slow_rank"):
                self.monitor(alert.job, partition).restore(alert)

    def revoke(self, partitions: set[int]) -> None:
        for job in [j for j, p in self.partition_of.items() if p in partitions]:
            self.monitors.pop(job, None)
            self.partition_of.pop(job, None)

    def tick(self, now_s: float) -> list[Alert]:
        out: list[Alert] = []
        for job, mon in list(self.monitors.items()):
            try:
                out += mon.scan(now_s, self.settings)
            except Exception as e:   # one job's bad state must not stop the others' rules
                log.exception("scan of job %s failed: %s", job, e)
            if not mon.shards and not mon.incidents:
                del self.monitors[job]
                self.partition_of.pop(job, None)
        return out
