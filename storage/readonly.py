"""Guarded read-only execution of user-written SQL against a Store (the console's, the CLI's, serve's).

Each call checks the statement with :func:`rankscope.sql_guard.check_readonly_sql`, then runs it on
a client of its own, opened for the call, whose default database is the store's (unqualified table
names work). With the embedded engine that client is a separate chDB session and the settings of
:func:`rankscope.sql_guard.readonly_settings` are applied to it by ``SET``: the shared client must
never see them, because clickhouse-connect applies per-call settings to some chDB calls by ``SET``
and restores them afterwards, and the restore fails once ``readonly=1`` is on, which would leave the
shared session (the sink's, in ``rankscope serve``) read-only for good. Against a server the
settings ride with the query.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pandas as pd

from rankscope.sql_guard import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ROWS,
    DEFAULT_TIMEOUT_S,
    check_readonly_sql,
    readonly_settings,
)
from rankscope.storage.store import Store, StoreError


@dataclass(frozen=True)
class SqlResult:
    """A guarded result: at most ``max_rows`` rows; ``truncated`` when ClickHouse had more."""

    sql: str
    frame: pd.DataFrame
    truncated: bool
    elapsed_s: float


def run_readonly(store: Store, sql: str, max_rows: int = DEFAULT_MAX_ROWS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 parameters: dict[str, Any] | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> SqlResult:
    """Run one user-written statement read-only and return its rows as a DataFrame. Blocks up to about ``timeout_s``.

    Raises :class:`rankscope.sql_guard.SqlRefused` for anything the guard refuses, and StoreError
    when ClickHouse refuses or fails (code 164 READONLY for writes, 159 TIMEOUT_EXCEEDED, syntax errors).
    """
    stmt = check_readonly_sql(sql)
    t0 = time.perf_counter()
    with readonly_session(store, max_rows, timeout_s, max_bytes) as (ro, settings):
        df = ro.query_df(stmt, parameters, settings=settings)
    truncated = len(df) > max_rows  # overflow mode 'break' stops at a block boundary past the limit
    return SqlResult(stmt, df.head(max_rows) if truncated else df, truncated, round(time.perf_counter() - t0, 3))


def run_readonly_arrow(store: Store, sql: str, max_rows: int = DEFAULT_MAX_ROWS,
                       timeout_s: float = DEFAULT_TIMEOUT_S, parameters: dict[str, Any] | None = None,
                       max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[Any, bool]:
    """Like :func:`run_readonly`, as a ``pyarrow.Table`` (ClickHouse's own Arrow types): (table, truncated)."""
    stmt = check_readonly_sql(sql)
    with readonly_session(store, max_rows, timeout_s, max_bytes) as (ro, settings):
        try:
            table = ro._client.query_arrow(stmt, parameters=parameters, settings=settings)
        except Exception as e:
            raise StoreError(f"{type(e).__name__}: {e}") from e
    truncated = table.num_rows > max_rows
    return (table.slice(0, max_rows) if truncated else table), truncated


@contextmanager
def readonly_session(store: Store, max_rows: int, timeout_s: float,
                     max_bytes: int) -> Iterator[tuple[Store, dict[str, Any] | None]]:
    """A read-only client of its own and the per-call settings to pass (None when the session holds them)."""
    settings = readonly_settings(max_rows, timeout_s, max_bytes)
    ro = _session(store)
    try:
        if store.embedded:
            for key, value in settings.items():
                ro.command(f"SET {key} = {repr(value) if isinstance(value, str) else value}")
            if str(ro.command("SELECT getSetting('readonly')")).strip() != "1":
                raise StoreError("the read-only session did not turn readonly on; refusing to run the query")
            yield ro, None
        else:
            yield ro, settings
    finally:
        ro.close()


def _session(store: Store) -> Store:
    import clickhouse_connect

    try:
        client = clickhouse_connect.get_client(dsn=store.dsn, database=store.database)
    except Exception as e:
        raise StoreError(f"cannot open a read-only session: {type(e).__name__}: {e}") from e
    return Store(client, store.dsn, database=store.database)
