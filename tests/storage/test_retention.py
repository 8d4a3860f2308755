"""Expiring tables against a real embedded ClickHouse (chDB): partitioned by day with TTLs from the
settings and ``ttl_only_drop_parts``; a table made before that is rebuilt with its rows; a TTL that
the writer's settings change is altered."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from rankscope.config import ConfigError, Settings
from rankscope.retention import TABLE_TTL_DAYS, table_ttl_days
from rankscope.storage.store import Store, apply_schema, close_store, open_store

pytestmark = pytest.mark.clickhouse

T0 = (time.time_ns() // 10**9 - 3600) * 10**9
OLD_HW_SAMPLES = """
CREATE TABLE {db}.hw_samples
(
    job LowCardinality(String), rank Int32, host LowCardinality(String), device Int32, ts_ns Int64,
    metric LowCardinality(String), value Float64,
    ts DateTime64(3) MATERIALIZED fromUnixTimestamp64Nano(ts_ns)
)
ENGINE = ReplacingMergeTree ORDER BY (job, host, device, metric, ts_ns)
TTL toDateTime(fromUnixTimestamp64Nano(ts_ns)) + INTERVAL 30 DAY
"""


def _layout(store: Store) -> dict[str, tuple[str, int, bool]]:
    """Per expiring table: its partition key, TTL days and whether it drops only whole parts."""
    out = {}
    for name, key, query in store.query_rows(
            "SELECT name, partition_key, create_table_query FROM system.tables WHERE database = {d:String}",
            {"d": store.database}):
        if name in TABLE_TTL_DAYS:
            m = re.search(r"toIntervalDay\((\d+)\)", query)
            out[name] = (key, int(m.group(1)) if m else -1, "ttl_only_drop_parts = 1" in query)
    return out


def test_expiring_tables_are_partitioned_by_day_with_their_ttls(tmp_path: Path) -> None:
    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn, ttl_days=table_ttl_days("hw_samples=7"))
    try:
        layout = _layout(store)
        assert set(layout) == set(TABLE_TTL_DAYS)
        for table, (key, days, drop_parts) in layout.items():
            assert key.startswith("toYYYYMMDD(fromUnixTimestamp64Nano(") and drop_parts, (table, key)
            assert days == (7 if table == "hw_samples" else TABLE_TTL_DAYS[table]), table
        apply_schema(store, table_ttl_days("hw_samples=3,trace_events=2"))   # the writer's settings changed
        apply_schema(store)                                                  # a reader's start-up changes nothing
        layout = _layout(store)
        assert layout["hw_samples"][1] == 3 and layout["trace_events"][1] == 2 and layout["heartbeats"][1] == 30
    finally:
        close_store(dsn)


def test_a_table_made_before_daily_partitions_is_rebuilt_with_its_rows(tmp_path: Path) -> None:
    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn, apply=False)
    try:
        db = store.database
        store.command(f"CREATE DATABASE IF NOT EXISTS {db}")
        store.command(OLD_HW_SAMPLES.replace("{db}", db))
        rows = [{"job": "j", "rank": r, "host": "h", "device": 0, "ts_ns": T0 + r, "metric": "gpu_util",
                 "value": float(r)} for r in range(50)]
        store.insert("hw_samples", rows)
        # A rebuild that stopped after the exchange left its staging table: it is dropped.
        apply_schema(store)
        store.command(f"CREATE TABLE {db}.hw_samples__by_day AS {db}.hw_samples")
        apply_schema(store)
        assert _layout(store)["hw_samples"][0] == "toYYYYMMDD(fromUnixTimestamp64Nano(ts_ns))"
        got = store.query_rows(f"SELECT count(), sum(value), min(ts) > '2020-01-01' FROM {db}.hw_samples")
        assert got == [(50, float(sum(range(50))), True)]
        assert store.query_rows(f"EXISTS TABLE {db}.hw_samples__by_day") == [(0,)]
    finally:
        close_store(dsn)


def test_ttl_overrides_are_checked_with_the_settings() -> None:
    assert Settings(store_ttl_days="hw_samples=7").store_ttl_days == "hw_samples=7"
    for bad in ("hw=7", "hw_samples=1.5", "hw_samples=0", "steps=3", "hw_samples"):
        with pytest.raises(ConfigError, match="store_ttl_days"):
            Settings(store_ttl_days=bad)
