"""Both stages of the processors in one object, without Kafka: messages in, alerts out.

Used by tests and offline replays: :meth:`TwoStage.apply` routes each message to the shard its
rank's partition would be (``shards`` of them), :meth:`TwoStage.scan` sends every shard's summary
to the job's :class:`~rankscope.stream_processors.monitor.JobMonitor` and evaluates the rules, as one scan
interval of the faust workers does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rankscope.config import Settings
from rankscope.protocol.alerts import Alert
from rankscope.protocol.envelope import Envelope
from rankscope.stream_processors.monitor import JobMonitor
from rankscope.stream_processors.shard import ShardJob


class TwoStage:
    def __init__(self, job: str, shards: int = 4, shard_of: Callable[[Envelope], int] | None = None) -> None:
        """``shard_of`` picks a message's shard (default: rank modulo ``shards``, as v2 keys spread)."""
        self.job = job
        self.n_shards = shards
        self.shard_of = shard_of or (lambda env: env.rank % shards)
        self.shards: dict[int, ShardJob] = {}
        self.monitor = JobMonitor(job=job)

    def apply(self, env: Envelope, now_s: float, settings: Settings) -> None:
        shard = self.shard_of(env)
        sj = self.shards.get(shard)
        if sj is None:
            sj = self.shards[shard] = ShardJob(self.job, shard)
        sj.apply(env, now_s, settings)

    def summarize(self, now_s: float, settings: Settings) -> None:
        for sj in self.shards.values():
            self.monitor.add_summary(sj.summary(now_s, settings))

    def scan(self, now_s: float, settings: Settings) -> list[Alert]:
        self.summarize(now_s, settings)
        return self.monitor.scan(now_s, settings)

    def rank_states(self, now_s: float, settings: Settings) -> dict[int, str]:
        return self.monitor.rank_states(now_s, settings)

    def progress_rows(self, now_s: float, settings: Settings) -> list[dict[str, Any]]:
        self.summarize(now_s, settings)
        return self.monitor.progress_rows(now_s, settings)

    @property
    def incidents(self) -> dict[str, dict[str, Any]]:
        return self.monitor.incidents
