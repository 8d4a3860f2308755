"""Trace windows in the store: the windows of a job, their ranks, their events, the ranks with Python
events and the Python call paths of their summaries. Pure query functions over a
:class:`~rankscope.storage.store.Store`, read by the dashboard's pages and ``rankscope export``.

Each blocks until ClickHouse answers and raises :class:`~rankscope.storage.store.StoreError` on
failure; values are bound as server-side parameters; an empty result is an empty DataFrame with the
documented columns.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from rankscope.storage.frames import as_datetime, check_positive
from rankscope.storage.store import Store

# Trace windows --------------------------------------------------------------------------------------

WINDOWS_COLUMNS = ["window_id", "request_id", "status", "ranks", "first_step", "last_step", "steps", "events",
                   "truncated_ranks", "start", "end", "duration_s", "updated"]
WINDOW_RANKS_COLUMNS = ["rank", "status", "first_step", "last_step", "events", "truncated", "start", "end",
                        "thread_cpu_s", "cpu_wait_share"]
EVENT_COLUMNS = ["rank", "category", "name", "start_ns", "dur_ns", "device", "stream", "step", "bytes", "attrs",
                 "correlation", "external_id"]
#: Most events one call reads (a window is capped by the ranks' byte budget; this guards the page).
MAX_EVENTS = 2_000_000


def trace_windows(store: Store, job: str, limit: int = 200) -> pd.DataFrame:
    """One row per trace window of a job (newest first), merged over its ranks: :data:`WINDOWS_COLUMNS`.

    ``status`` is the ranks' common status, or e.g. ``complete ×3, stopped ×1`` when they differ;
    ``steps`` is last - first + 1; ``truncated_ranks`` counts ranks whose events hit the byte budget.
    ``request_id`` is the window id without its ``-<k>`` counter.
    """
    check_positive("limit", limit)
    db = store.database
    sql = f"""
        SELECT window_id,
               arraySort(groupArray(rank)) AS ranks,
               arraySort(groupArray(toString(status))) AS statuses,
               min(first_step) AS first_step, max(last_step) AS last_step,
               min(start_ns) AS start_ns, max(end_ns) AS end_ns,
               toInt64(sum(events)) AS events, toInt64(sum(truncated)) AS truncated_ranks,
               max(updated_ns) AS updated_ns
        FROM (SELECT * FROM {db}.trace_windows WHERE job = {{job:String}}
              ORDER BY updated_ns DESC LIMIT 1 BY window_id, rank)
        GROUP BY window_id
        ORDER BY start_ns DESC, window_id
        LIMIT {{limit:UInt32}}
    """
    df = store.query_df(sql, {"job": job, "limit": int(limit)})
    if df.empty:
        return pd.DataFrame(columns=WINDOWS_COLUMNS)
    df["ranks"] = df["ranks"].map(lambda r: [int(x) for x in r])
    df["status"] = df["statuses"].map(_merge_statuses)
    df["request_id"] = df["window_id"].map(lambda w: str(w).rsplit("-", 1)[0])
    df["steps"] = (df["last_step"] - df["first_step"] + 1).clip(lower=0)
    df["start"], df["end"], df["updated"] = as_datetime(df["start_ns"]), as_datetime(df["end_ns"]), as_datetime(df["updated_ns"])
    df["duration_s"] = ((df["end_ns"] - df["start_ns"]).clip(lower=0) / 1e9).round(3)
    return df[WINDOWS_COLUMNS].reset_index(drop=True)


def _merge_statuses(statuses: Any) -> str:
    counts = pd.Series([str(s) for s in statuses]).value_counts()
    if len(counts) == 1:
        return str(counts.index[0])
    return ", ".join(f"{s} ×{n}" for s, n in counts.items())


def trace_window_ranks(store: Store, job: str, window_id: str) -> pd.DataFrame:
    """The per-rank rows of one window (latest version of each): :data:`WINDOW_RANKS_COLUMNS`.

    ``thread_cpu_s`` is the training thread's CPU time over the window; ``cpu_wait_share`` the share of
    the time it was ready to run (on a CPU or runnable) that it waited for a CPU. Both are NaN for a
    rank that does not send its thread's CPU times.
    """
    db = store.database
    sql = f"""
        SELECT rank, toString(status) AS status, first_step, last_step, events, truncated = 1 AS truncated,
               start_ns, end_ns, thread_cpu_ns, thread_runq_ns
        FROM {db}.trace_windows WHERE job = {{job:String}} AND window_id = {{w:String}}
        ORDER BY rank, updated_ns DESC LIMIT 1 BY rank
    """
    df = store.query_df(sql, {"job": job, "w": window_id})
    if df.empty:
        return pd.DataFrame(columns=WINDOW_RANKS_COLUMNS)
    df["truncated"] = df["truncated"].astype(bool)
    df["start"], df["end"] = as_datetime(df["start_ns"]), as_datetime(df["end_ns"])
    cpu, runq = df["thread_cpu_ns"].astype(float), df["thread_runq_ns"].astype(float)
    known = (cpu >= 0) & (runq >= 0)
    df["thread_cpu_s"] = (cpu / 1e9).where(known).round(3)
    df["cpu_wait_share"] = (runq / (cpu + runq)).where(known & (cpu + runq > 0)).round(3)
    return df[WINDOW_RANKS_COLUMNS].reset_index(drop=True)


def trace_events(store: Store, job: str, window_id: str, ranks: list[int] | None = None,
                 categories: list[str] | None = None, limit: int = MAX_EVENTS) -> pd.DataFrame:
    """Raw events of one window (all ranks, or ``ranks``; all categories, or ``categories``), by start.

    Columns: :data:`EVENT_COLUMNS`; ``attrs`` is a dict; ``correlation`` and ``external_id`` are
    Kineto's launch links (-1: none). At most ``limit`` rows (earliest first).
    """
    check_positive("limit", limit)
    db = store.database
    sql = f"""
        SELECT rank, toString(category) AS category, toString(name) AS name, start_ns, dur_ns, device, stream,
               step, bytes, attrs, correlation, external_id
        FROM {db}.trace_events
        WHERE job = {{job:String}} AND window_id = {{w:String}}
          AND ({{all_ranks:UInt8}} OR rank IN {{ranks:Array(Int32)}})
          AND ({{all_cats:UInt8}} OR category IN {{cats:Array(String)}})
        ORDER BY rank, start_ns
        LIMIT {{limit:UInt32}}
    """
    df = store.query_df(sql, {"job": job, "w": window_id, "all_ranks": int(ranks is None), "ranks": list(ranks or []),
                              "all_cats": int(categories is None), "cats": list(categories or []),
                              "limit": int(limit)})
    if df.empty:
        return pd.DataFrame(columns=EVENT_COLUMNS)
    df["attrs"] = df["attrs"].map(lambda a: dict(a) if a else {})
    return df[EVENT_COLUMNS].reset_index(drop=True)


def window_event_ranks(store: Store, job: str, window_id: str, category: str = "python") -> list[int]:
    """Ranks that have events of ``category`` in a window, sorted."""
    db = store.database
    sql = f"""
        SELECT DISTINCT rank FROM {db}.trace_events
        WHERE job = {{job:String}} AND window_id = {{w:String}} AND category = {{c:String}}
        ORDER BY rank
    """
    return [int(r[0]) for r in store.query_rows(sql, {"job": job, "w": window_id, "c": category})]


PYTHON_PATH_COLUMNS = ["rank", "category", "name", "exclusive_ns"]


def window_python_paths(store: Store, job: str, window_id: str) -> pd.DataFrame:
    """Python call paths of a window's summaries with their self time: :data:`PYTHON_PATH_COLUMNS`
    (``name`` is ``root;...;leaf``), for the folded-stack and speedscope exports."""
    db = store.database
    sql = f"""
        SELECT rank, toString(category) AS category, name, toInt64(sum(exclusive_ns)) AS exclusive_ns
        FROM {db}.function_summaries FINAL
        WHERE job = {{job:String}} AND window_id = {{w:String}} AND category = 'python'
        GROUP BY rank, category, name ORDER BY rank, name
    """
    df = store.query_df(sql, {"job": job, "w": window_id})
    return df if not df.empty else pd.DataFrame(columns=PYTHON_PATH_COLUMNS)
