"""Topic names, declared once. Real names carry the configured prefix."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rankscope.config import Settings


class Topic(enum.Enum):
    """Logical topics. Keys: job id for steps/control/alerts/stats; "job/rank" for bulky ones."""

    STEPS = "steps"          # beats (v2), step records and heartbeats (v1), exit records (msgpack;
                             # key = job/rank from v2 ranks, job from v1 ranks)
    HW = "hw"                # hardware samples (msgpack, key = job/rank)
    TRACES = "traces"        # trace-window events (msgpack, key = job/rank)
    PROFILES = "profiles"    # each rank's sampled Python stacks, one message per interval (msgpack, key = job/rank)
    SUMMARIES = "summaries"  # per-window per-rank function summaries (msgpack, key = job)
    CONTROL = "control"      # commands to ranks (msgpack, key = job); every rank of the job reads it
    REPLIES = "replies"      # the ranks' answers: acks, step histories and Flight Recorder dumps (msgpack, key = job); no rank
                             # reads it, so a window's N acks are not fetched by N ranks (N^2 at scale)
    SHARDS = "shards"        # the processors' per-partition job summaries (msgpack, key = job)
    STATS = "stats"          # rolling per-worker statistics (msgpack, key = job)
    ALERTS = "alerts"        # alerts (JSON, documented schema, key = job)
    REPORTS = "reports"      # diagnosis reports (JSON, key = job)
    DEADLETTER = "deadletter"  # undecodable input with the reason (JSON, key = source topic)

    def name_for(self, settings: Settings) -> str:
        return f"{settings.topic_prefix}{self.value}"


def all_topic_names(settings: Settings) -> dict[Topic, str]:
    return {t: t.name_for(settings) for t in Topic}



_HOUR_MS = 3_600_000


def topic_configs(settings: Settings) -> dict[Topic, dict[str, str]]:
    """The Kafka topic configuration rankscope creates each topic with: its retention
    (rankscope/retention.py), and ``min.insync.replicas`` when set."""
    from rankscope.retention import topic_retention_h

    hours = topic_retention_h(settings.topic_retention_h)
    out = {}
    for t in Topic:
        conf = {"retention.ms": str(int(hours[t.value] * _HOUR_MS))}
        if settings.topic_min_insync:
            conf["min.insync.replicas"] = str(settings.topic_min_insync)
        out[t] = conf
    return out
