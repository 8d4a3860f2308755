"""The store client against a real embedded ClickHouse (chDB) in a temporary directory."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rankscope.storage.columns import ARROW_TYPES, TABLE_COLUMNS
from rankscope.storage.store import (
    Store,
    StoreError,
    StoreLocked,
    apply_schema,
    close_store,
    open_store,
    schema_statements,
)

pytestmark = pytest.mark.clickhouse

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    dsn = f"chdb://{tmp_path / 'ch'}"
    s = open_store(dsn)
    try:
        yield s
    finally:
        close_store(dsn)


def _tables(store: Store) -> list[str]:
    return sorted(r[0] for r in store.query_rows(f"SHOW TABLES FROM {store.database}"))


def test_schema_applies_twice_idempotently(store: Store) -> None:
    first = _tables(store)
    assert {"steps", "heartbeats", "ranks", "jobs", "worker_stats", "alerts", "alert_events", "deadletters",
            "hw_samples", "trace_events", "function_summaries", "trace_windows", "reports"} <= set(first)
    store.insert("jobs", [{"job": "j", "world_size": 2, "first_seen_ns": 1, "last_seen_ns": 2}])
    apply_schema(store)
    apply_schema(store)
    assert _tables(store) == first
    assert store.query_rows("SELECT job, world_size FROM rankscope.jobs") == [("j", 2)]
    assert len(schema_statements()) == len(first) + 1  # + CREATE DATABASE


def test_insert_and_query(store: Store) -> None:
    rows = [{"job": "j", "rank": r, "step": s, "start_ns": s * 100, "end_ns": s * 100 + 50, "duration_ns": 50,
             "comm_ns": 10, "busy_ns": 40, "host": "h", "pid": 7, "seq": s} for r in range(2) for s in range(3)]
    assert store.insert("steps", rows) == 6
    assert store.insert_columns("steps", {"job": ["j"], "rank": [5], "step": [0], "start_ns": [0], "end_ns": [9],
                                          "duration_ns": [9], "comm_ns": [0], "busy_ns": [9], "host": ["h"],
                                          "pid": [7], "seq": [0]}) == 1
    assert store.insert("steps", []) == 0
    df = store.query_df("SELECT rank, count() AS n, sum(busy_ns) AS busy FROM rankscope.steps FINAL "
                        "WHERE job = {job:String} GROUP BY rank ORDER BY rank", parameters={"job": "j"})
    assert df.to_dict("records") == [{"rank": 0, "n": 3, "busy": 120}, {"rank": 1, "n": 3, "busy": 120},
                                     {"rank": 5, "n": 1, "busy": 9}]
    # Re-inserting the same rows is idempotent under FINAL (ReplacingMergeTree).
    store.insert("steps", rows)
    assert store.query_rows("SELECT count() FROM rankscope.steps FINAL") == [(7,)]
    empty = store.query_df("SELECT job, rank FROM rankscope.steps WHERE job = 'nope'")
    assert empty.empty and list(empty.columns) == ["job", "rank"]
    with pytest.raises(StoreError):
        store.query_df("SELECT * FROM rankscope.no_such_table")


@pytest.mark.parametrize("table", sorted(ARROW_TYPES))
def test_arrow_insert_stores_what_the_native_insert_stores(store: Store, table: str) -> None:
    names = TABLE_COLUMNS[table]
    assert set(ARROW_TYPES[table]) == set(names)

    def value(name: str, kind: str, i: int) -> Any:
        if kind == "dict":
            return f"{name}-{i % 3}"
        if kind in ("float64", "float32"):
            return i * 1.25 - 3.0      # exact in both
        if kind == "uint32":
            return 2**32 - 1 - i if i % 2 else i * 10**7
        if kind == "int32":
            return -(2**31) + i if i % 2 else i * 10**7
        return 1_800_000_000 * 10**9 + i * 10**9 + i   # recent: the tables' TTLs drop old rows

    def columns(job: str) -> dict[str, list[Any]]:
        cols = {n: [value(n, ARROW_TYPES[table][n], i) for i in range(50)] for n in names}
        return {**cols, "job": [job] * 50}

    assert store.insert_columns(table, columns("native")) == 50
    assert store.insert_columns(table, columns("arrow"), ARROW_TYPES[table]) == 50
    cols = ", ".join(n for n in names if n != "job")
    read = {job: store.query_rows(f"SELECT {cols} FROM rankscope.{table} WHERE job = '{job}' ORDER BY {cols}")
            for job in ("native", "arrow")}
    assert len(read["arrow"]) == 50 and read["arrow"] == read["native"]
    assert store.query_rows(f"SELECT toTypeName(job) FROM rankscope.{table} LIMIT 1") == [("LowCardinality(String)",)]
    with pytest.raises(StoreError):   # a value out of its column's range is refused, not wrapped
        store.insert_columns(table, {**columns("bad"), "rank": [2**31] * 50}, ARROW_TYPES[table])


def test_open_store_is_shared_and_reopens_after_close(tmp_path: Path) -> None:
    dsn = f"chdb://{tmp_path / 'ch'}"
    s = open_store(dsn)
    try:
        assert open_store(dsn) is s
        s.insert("jobs", [{"job": "kept", "world_size": 1, "first_seen_ns": 1, "last_seen_ns": 1}])
    finally:
        close_store(dsn)
    s2 = open_store(dsn)
    try:
        assert s2 is not s
        assert s2.query_rows("SELECT job FROM rankscope.jobs") == [("kept",)]
    finally:
        close_store(dsn)


def test_second_directory_in_same_process_is_a_clear_error(store: Store, tmp_path: Path) -> None:
    other = f"chdb://{tmp_path / 'other'}"
    with pytest.raises(StoreError, match="this process already has another embedded store open") as info:
        open_store(other)
    assert not isinstance(info.value, StoreLocked)


def test_store_locked_when_another_process_holds_the_directory(store: Store) -> None:
    probe = textwrap.dedent(f"""
        import sys
        from rankscope.storage.store import StoreLocked, open_store
        try:
            open_store({store.dsn!r})
        except StoreLocked as e:
            print("LOCKED", e)
            sys.exit(3)
        print("OPENED")
    """)
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "LOCKED" in proc.stdout and "open in another process" in proc.stdout
