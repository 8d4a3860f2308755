"""The processors' two stages as plain objects with explicit state; the faust app only wires them.

- :class:`ShardStage` owns the steps partitions assigned to this worker: one
  :class:`~rankscope.stream_processors.shard.ShardJob` per (partition, job). Each tick it emits every
  shard's bounded summary (``shards`` topic, key = job) and the rolling per-rank statistics. It also
  takes the ranks' profiles from the profiles partitions of the same numbers (same key, job/rank).
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
from rankscope.protocol import profile
from rankscope.stream_processors import profile_digest
from rankscope.stream_processors.monitor import JobMonitor
from rankscope.stream_processors.shard import ShardJob
from rankscope.stream_processors.shard_summary import ShardSummary
from rankscope.topics import Topic
from rankscope.wire import Envelope, encode

log = logging.getLogger("rankscope.processors")

Message = tuple[Topic, bytes, bytes]
STEPS_KINDS = ("beat", "steps", "heartbeat", "exit")


class EnvelopeEncoder:
    """The envelope fields of what this worker publishes, with its own sequence numbers."""

    def __init__(self, host: str, pid: int) -> None:
        self.host, self.pid = host, pid
        self._seq = itertools.count(1)

    def envelope(self, kind: str, job: str, body: dict, sent_ns: int) -> bytes:
        return encode(Envelope(kind=kind, job=job, rank=-1, host=self.host, pid=self.pid, seq=next(self._seq),
                               sent_ns=sent_ns, body=body))


class ShardStage:
    """The steps partitions of this worker. Besides the shards it keeps, per partition, the newest
    send time read from it and whether more messages were waiting then (:meth:`mark_read`): while
    a partition is read late, its shards are judged at that send time, not at the wall clock."""

    def __init__(self, settings: Settings, sender: EnvelopeEncoder) -> None:
        self.settings = settings
        self.sender = sender
        self.shards: dict[tuple[int, str], ShardJob] = {}
        self.newest_sent_ns: dict[int, int] = {}
        self.behind: set[int] = set()
        # Partitions whose leader is down (:meth:`mark_reachable`), and, once it is back, until when
        # they are still judged at their newest send time: the ranks' producers deliver what they
        # held meanwhile only after they learn the new leader.
        self.unreachable: set[int] = set()
        self.recovering_until_s: dict[int, float] = {}

    def ingest(self, partition: int, env: Envelope, now_s: float) -> None:
        key = (partition, env.job)
        sj = self.shards.get(key)
        if sj is None:
            sj = self.shards[key] = ShardJob(env.job, partition)
        sj.apply(env, now_s, self.settings)
        if env.sent_ns > self.newest_sent_ns.get(partition, 0):
            self.newest_sent_ns[partition] = env.sent_ns

    def ingest_profile(self, partition: int, env: Envelope) -> bool:
        """A rank's ``profile`` message read from the profiles partition of the same number: its
        digest joins the rank's shard (False when the shard holds no such job yet, or the message
        no training thread)."""
        sj = self.shards.get((partition, env.job))
        if sj is None:
            return False
        body = profile.from_validated(env.body)
        shares = profile_digest.digest(body)
        if not shares:
            return False
        sj.add_profile(env.rank, body.t1_ns, shares)
        return True

    def mark_read(self, partition: int, waiting: bool) -> None:
        """After a batch: were more messages of ``partition`` waiting past the last one read?"""
        if waiting:
            self.behind.add(partition)
        else:
            self.behind.discard(partition)

    def mark_reachable(self, unreachable: set[int], now_s: float) -> None:
        """The partitions whose leader cannot be reached now (from the consumer's statistics). While
        a partition's leader is down its ranks cannot deliver, so their silence is no evidence: it
        is judged at the partition's newest send time, then for ``dead_after_s`` after the leader is
        back, while the ranks' producers send what they held."""
        for p in self.unreachable - unreachable:
            self.recovering_until_s[p] = now_s + self.settings.dead_after_s
        self.unreachable = set(unreachable)
        for p in [p for p, until in self.recovering_until_s.items() if until <= now_s or p in self.unreachable]:
            del self.recovering_until_s[p]

    def frontier_s(self, partition: int, now_s: float) -> float:
        """The time up to which ``partition`` has been read: ``now_s`` when caught up, else the
        newest send time read from it (also while its leader is down, and just after)."""
        late = (partition in self.behind or partition in self.unreachable
                or self.recovering_until_s.get(partition, 0.0) > now_s)
        if late and partition in self.newest_sent_ns:
            return min(now_s, self.newest_sent_ns[partition] / 1e9)
        return now_s

    def install(self, rebuilt: Iterable[ShardJob]) -> None:
        """Take the state rebuilt from recent input for newly assigned partitions."""
        for sj in rebuilt:
            self.shards[(sj.shard, sj.job)] = sj

    def revoke(self, partitions: set[int]) -> None:
        for key in [k for k in self.shards if k[0] in partitions]:
            del self.shards[key]
        for p in partitions:
            self.newest_sent_ns.pop(p, None)
            self.behind.discard(p)
            self.unreachable.discard(p)
            self.recovering_until_s.pop(p, None)

    def tick(self, now_s: float) -> list[Message]:
        """Every shard's summary and statistics; jobs idle for ``job_idle_s`` are retired."""
        out: list[Message] = []
        now_ns = int(now_s * 1e9)
        for key, sj in list(self.shards.items()):
            frontier_s = self.frontier_s(sj.shard, now_s)
            newest = max((st.hb_s for st in sj.ranks.values()), default=sj.last_input_s)
            retired = frontier_s - newest > self.settings.job_idle_s
            summary = sj.summary(now_s, self.settings, retired=retired, frontier_s=frontier_s)
            out.append((Topic.SHARDS, sj.job.encode(), self.sender.envelope("shard", sj.job, summary.to_body(), now_ns)))
            if retired:
                del self.shards[key]
                continue
            if summary.agg["new_steps"] or summary.agg["silent"]:
                for rows in sj.stats_chunks(now_s, self.settings, frontier_s):
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
