"""How long rankscope keeps what it moves and stores, declared once: each Kafka topic's retention and
each expiring ClickHouse table's TTL, and the settings that override them ("name=number,...")."""

from __future__ import annotations

from collections.abc import Iterable

# Hours Kafka keeps each topic, for what it carries: rank data long enough for a sink or processors
# outage over a weekend to be caught up, bulky trace windows and profiles a day, the request/answer
# and internal topics a day, and what people and other systems read (alerts, reports, dead letters)
# a week. Keys are rankscope.topics.Topic values.
TOPIC_RETENTION_H: dict[str, float] = {
    "steps": 72, "hw": 72, "traces": 24, "profiles": 24, "summaries": 72, "control": 24, "replies": 24,
    "shards": 24, "stats": 24, "alerts": 168, "reports": 168, "deadletter": 168,
}

# Days ClickHouse keeps the rows of each table that expires (partitioned by day, so a day's rows
# leave as one part). Tables not listed keep their rows (jobs, ranks, steps, alerts, reports, ...).
TABLE_TTL_DAYS: dict[str, int] = {
    "heartbeats": 30, "deadletters": 30, "hw_samples": 30, "trace_events": 14, "fr_dumps": 90,
    "profile_samples": 14, "flight_records": 90,
}


class RetentionError(ValueError):
    """A retention override that names nothing known or is not a positive number."""


def overrides(spec: str, known: Iterable[str], setting: str, integer: bool = False) -> dict[str, float]:
    """``"traces=12, alerts=720"`` as {name: number}, each name one of ``known``. Raises
    RetentionError naming ``setting`` and the bad entry."""
    names = list(known)
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, number = (x.strip() for x in part.partition("="))
        try:
            value = int(number) if integer else float(number)
        except ValueError:
            value = 0
        if not sep or name not in names or not value > 0:
            unit = "whole days" if integer else "hours"
            raise RetentionError(f"{setting}: {part!r} is not name={unit} (> 0) with a name of {', '.join(names)}")
        out[name] = value
    return out


def topic_retention_h(spec: str = "") -> dict[str, float]:
    """Each topic's retention in hours, with the ``topic_retention_h`` overrides."""
    return {**TOPIC_RETENTION_H, **overrides(spec, TOPIC_RETENTION_H, "topic_retention_h")}


def table_ttl_days(spec: str = "") -> dict[str, int]:
    """Each expiring table's TTL in days, with the ``store_ttl_days`` overrides."""
    return {**TABLE_TTL_DAYS, **{k: int(v) for k, v in overrides(spec, TABLE_TTL_DAYS, "store_ttl_days",
                                                                   integer=True).items()}}
