"""Numbered migrations against a real embedded ClickHouse (chDB): a store made by an older schema
gains the new columns once, its rows keep their values and get the columns' defaults."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rankscope.storage.store import apply_schema, close_store, migration_statements, open_store

pytestmark = pytest.mark.clickhouse

T0 = (time.time_ns() // 10**9 - 3600) * 10**9   # recent: trace_events expires rows after 14 days
# trace_events as schema.sql created it before 0001_trace_event_links.
OLD_TRACE_EVENTS = """
CREATE TABLE {db}.trace_events
(
    job LowCardinality(String), window_id String, rank Int32, category LowCardinality(String),
    name LowCardinality(String), start_ns Int64, dur_ns Int64, device Int32, stream Int32, step Int64,
    bytes Int64, attrs Map(LowCardinality(String), String)
)
ENGINE = MergeTree ORDER BY (job, window_id, rank, start_ns)
"""
ROW = {"job": "j", "window_id": "w-0", "rank": 0, "category": "kernel", "device": 0, "stream": 7, "step": 1,
       "bytes": 0, "attrs": {}, "dur_ns": 10}


def test_trace_event_links_migration_on_an_older_store(tmp_path: Path) -> None:
    assert [(v, n) for v, n, _ in migration_statements()][:1] == [(1, "trace_event_links")]
    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn, apply=False)
    try:
        db = store.database
        store.command(f"CREATE DATABASE IF NOT EXISTS {db}")
        store.command(OLD_TRACE_EVENTS.replace("{db}", db))
        store.insert("trace_events", [{**ROW, "name": "old", "start_ns": T0}])
        apply_schema(store)
        apply_schema(store)                                     # applied once, recorded
        assert store.query_rows(f"SELECT version FROM {db}.schema_migrations FINAL WHERE version = 1") == [(1,)]
        store.insert("trace_events", [{**ROW, "name": "new", "start_ns": T0 + 1, "correlation": 7,
                                       "external_id": 3}])
        rows = store.query_rows(f"SELECT toString(name), correlation, external_id FROM {db}.trace_events "
                                "ORDER BY start_ns")
        assert rows == [("old", -1, -1), ("new", 7, 3)]
    finally:
        close_store(dsn)


def test_a_new_store_has_the_columns_and_the_migration_recorded(tmp_path: Path) -> None:
    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn)
    try:
        db = store.database
        cols = dict(store.query_rows(f"SELECT name, type FROM system.columns WHERE database = '{db}' "
                                     "AND table = 'trace_events'"))
        assert cols["correlation"] == cols["external_id"] == "Int64"
        assert store.query_rows(f"SELECT version FROM {db}.schema_migrations FINAL WHERE version = 1") == [(1,)]
    finally:
        close_store(dsn)


# trace_windows as schema.sql created it before 0004_trace_window_thread_cpu.
OLD_TRACE_WINDOWS = """
CREATE TABLE {db}.trace_windows
(
    job LowCardinality(String), window_id String, rank Int32, status LowCardinality(String), first_step Int64,
    last_step Int64, start_ns Int64, end_ns Int64, events Int64, truncated UInt8, updated_ns Int64
)
ENGINE = ReplacingMergeTree(updated_ns) ORDER BY (job, window_id, rank)
"""


def test_trace_window_thread_cpu_migration_on_an_older_store(tmp_path: Path) -> None:
    assert (4, "trace_window_thread_cpu") in [(v, n) for v, n, _ in migration_statements()]
    dsn = f"chdb://{tmp_path / 'ch'}"
    store = open_store(dsn, apply=False)
    window = {"job": "j", "status": "complete", "first_step": 1, "last_step": 3, "start_ns": T0, "end_ns": T0 + 9,
              "events": 5, "truncated": 0, "updated_ns": T0}
    try:
        db = store.database
        store.command(f"CREATE DATABASE IF NOT EXISTS {db}")
        store.command(OLD_TRACE_WINDOWS.replace("{db}", db))
        store.insert("trace_windows", [{**window, "window_id": "old", "rank": 0}])
        apply_schema(store)
        apply_schema(store)
        assert store.query_rows(f"SELECT version FROM {db}.schema_migrations FINAL WHERE version = 4") == [(4,)]
        store.insert("trace_windows", [{**window, "window_id": "new", "rank": 0, "thread_cpu_ns": 7,
                                        "thread_runq_ns": 3}])
        rows = store.query_rows(f"SELECT window_id, events, thread_cpu_ns, thread_runq_ns FROM {db}.trace_windows "
                                "ORDER BY window_id")
        assert rows == [("new", 5, 7, 3), ("old", 5, -1, -1)]
    finally:
        close_store(dsn)
