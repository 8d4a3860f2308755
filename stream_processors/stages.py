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

from rankscope.config import Settings
from rankscope.protocol import profile
from rankscope.protocol.alerts import Alert
from rankscope.protocol.envelope import Envelope, encode
from rankscope.stream_processors import profile_digest
from rankscope.stream_processors.monitor import JobMonitor
from rankscope.stream_processors.shard import ShardJob
from rankscope.stream_processors.shard_summary import ShardSummary
from rankscope.topics import Topic

log = logging.getLogger("rankscope.processors")

Message = tuple[Topic, bytes, bytes]
STEPS_KINDS = ("beat", "steps", "heartbeat", "exit")
# Once a partition's leader is back, its ranks are judged at the time it went down until they all
# delivered again, for at most this many dead_after_s.
RECOVERY_FACTOR = 3.0


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
        # Partitions whose leader is down (:meth:`mark_reachable`), the newest send time read from
        # each before it went down, and, once it is back, until when at most its ranks are still
        # judged at that time: their producers deliver what they held only after they learn the
        # new leader.
        self.unreachable: set[int] = set()
        self.outage_from_s: dict[int, float] = {}
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

    def mark_reachable(self, unreachable: set[int], now_s: float, stalled: set[int] | None = None) -> None:
        """The partitions whose leader cannot be reached now (from the consumer's statistics). While
        a partition's leader is down its ranks cannot deliver, so their silence is no evidence: it
        is judged at the newest send time read from it before the leader went down. Once the leader
        is back it stays judged there until every rank that was live then has delivered something
        sent after it (:meth:`frontier_s`), for at most ``RECOVERY_FACTOR x dead_after_s``: a rank
        that died meanwhile is found then.

        ``stalled``: partitions whose leader is up, given when a broker has just gone down. It
        holds a replica of theirs too, and writes wait for every in-sync replica (``acks=all``), so
        nothing new can be read from them until the controller drops that broker from their in-sync
        replicas (its session timeout); their ranks' producers then deliver what they held, some
        sooner than others. They are judged as partitions whose leader just came back."""
        for p in unreachable - self.unreachable:
            if p not in self.outage_from_s:
                self.outage_from_s[p] = self.newest_sent_ns.get(p, int(now_s * 1e9)) / 1e9
        for p in self.unreachable - unreachable:
            self.recovering_until_s[p] = now_s + RECOVERY_FACTOR * self.settings.dead_after_s
        for p in (stalled or set()) - unreachable:
            if p not in self.outage_from_s:
                self.outage_from_s[p] = self.newest_sent_ns.get(p, int(now_s * 1e9)) / 1e9
                self.recovering_until_s[p] = now_s + RECOVERY_FACTOR * self.settings.dead_after_s
        self.unreachable = set(unreachable)
        for p in [p for p, until in self.recovering_until_s.items() if until <= now_s or p in self.unreachable]:
            del self.recovering_until_s[p]
        for p in [p for p in self.outage_from_s if p not in self.unreachable and p not in self.recovering_until_s]:
            del self.outage_from_s[p]

    def _caught_up(self, partition: int) -> bool:
        """Has every rank of ``partition`` that was live when its leader went down delivered a
        message sent after that?"""
        since = self.outage_from_s[partition]
        return all(st.hb_s > since for (p, _job), sj in self.shards.items() if p == partition
                   for st in sj.ranks.values()
                   if not st.exit_reason and st.hb_s >= since - self.settings.dead_after_s)

    def frontier_s(self, partition: int, now_s: float) -> float:
        """The time up to which ``partition`` has been read: ``now_s`` when caught up, else the
        newest send time read from it; while its leader is down, and after until its ranks caught
        up, the newest send time read before that."""
        if partition in self.outage_from_s and (
                partition in self.unreachable
                or (self.recovering_until_s.get(partition, 0.0) > now_s and not self._caught_up(partition))):
            return min(now_s, self.outage_from_s[partition])
        if partition in self.behind and partition in self.newest_sent_ns:
            return min(now_s, self.newest_sent_ns[partition] / 1e9)
        return now_s

    def install(self, rebuilt: Iterable[ShardJob]) -> None:
        """Take the state rebuilt from recent input for newly assigned partitions, and the newest
        send time read of each partition."""
        for sj in rebuilt:
            self.shards[(sj.shard, sj.job)] = sj
            newest_ns = int(max((st.hb_s for st in sj.ranks.values()), default=0.0) * 1e9)
            if newest_ns > self.newest_sent_ns.get(sj.shard, 0):
                self.newest_sent_ns[sj.shard] = newest_ns

    def revoke(self, partitions: set[int]) -> None:
        for key in [k for k in self.shards if k[0] in partitions]:
            del self.shards[key]
        for p in partitions:
            self.newest_sent_ns.pop(p, None)
            self.behind.discard(p)
            self.unreachable.discard(p)
            self.outage_from_s.pop(p, None)
            self.recovering_until_s.pop(p, None)

    def tick(self, now_s: float) -> list[Message]:
        """Every shard's summary and statistics; jobs idle for ``job_idle_s`` are retired."""
        out: list[Message] = []
        now_ns = int(now_s * 1e9)
        frontiers: dict[int, float] = {}
        for key, sj in list(self.shards.items()):
            if sj.shard not in frontiers:
                frontiers[sj.shard] = self.frontier_s(sj.shard, now_s)
            frontier_s = frontiers[sj.shard]
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
        # Shards partitions whose summaries are not taken now: revoked ones, and newly assigned ones
        # until their open incidents are restored (a summary judged before that would open again,
        # under a new id, an incident the previous owner opened).
        self.closed: set[int] = set()

    def monitor(self, job: str, partition: int) -> JobMonitor:
        mon = self.monitors.get(job)
        if mon is None:
            mon = self.monitors[job] = JobMonitor(job=job)
        self.partition_of[job] = partition
        return mon

    def ingest(self, partition: int, env: Envelope) -> None:
        """Keep one shard summary (raises WireError when its body is invalid), unless its partition
        is closed now."""
        if partition not in self.closed:
            self.monitor(env.job, partition).add_summary(ShardSummary.from_body(env.body))

    def assigning(self, partitions: Iterable[int]) -> None:
        """Newly assigned partitions: their summaries wait until :meth:`restore` took their incidents."""
        self.closed |= set(partitions)

    def restore(self, partition: int, alerts: Iterable[Alert]) -> None:
        """Open incidents read back from the alerts topic (in publication order) keep their ids;
        the partition's summaries are taken from now on."""
        for alert in alerts:
            if alert.kind in ("hang", "dead_rank", "slow_rank"):
                self.monitor(alert.job, partition).restore(alert)
        self.closed.discard(partition)

    def revoke(self, partitions: set[int]) -> None:
        for job in [j for j, p in self.partition_of.items() if p in partitions]:
            self.monitors.pop(job, None)
            self.partition_of.pop(job, None)
        self.closed |= partitions

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
