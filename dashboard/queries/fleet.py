"""The fleet: hosts, GPU utilisation, and each host's hardware time series."""

from __future__ import annotations

import pandas as pd

from rankscope.dashboard.queries.common import as_datetime, check_positive, now_or_wall_ns
from rankscope.sql_guard import READONLY_STATEMENTS as READONLY_STATEMENTS
from rankscope.sql_guard import SqlRefused as SqlRefused
from rankscope.sql_guard import check_readonly_sql as check_readonly_sql
from rankscope.sql_guard import readonly_settings as readonly_settings
from rankscope.storage.readonly import SqlResult as SqlResult
from rankscope.storage.readonly import run_readonly as run_readonly
from rankscope.storage.store import Store
from rankscope.storage.store import StoreError as StoreError

# Fleet ------------------------------------------------------------------------------------------

HOSTS_COLUMNS = ["host", "ranks", "live_ranks", "jobs", "gpus", "gpu_util_mean", "gpu_util_min",
                 "gpu_util_max", "last_seen", "last_seen_age_s"]


def hosts(store: Store, window_s: float = 300.0, live_within_s: float = 30.0,
          now_ns: int | None = None) -> pd.DataFrame:
    """One row per host: ranks placed there (all time and live), its jobs, and GPU utilisation.

    GPU columns summarise ``hw_samples`` metric ``gpu_util`` (percent) over the last ``window_s``
    seconds; they are NaN (and ``gpus`` 0) when the host sent none. A rank is live when seen within
    ``live_within_s`` seconds and not exited.
    """
    check_positive("window_s", window_s)
    check_positive("live_within_s", live_within_s)
    now = now_or_wall_ns(now_ns)
    db = store.database
    sql = f"""
        WITH
          r AS (
            SELECT host, toInt64(count()) AS ranks,
                   toInt64(countIf(x_exit = '' AND x_seen >= {{live:Int64}})) AS live_ranks,
                   arraySort(groupUniqArray(toString(job))) AS jobs, max(x_seen) AS last_seen_ns
            FROM (SELECT job, rank, toString(argMax(host, last_seen_ns)) AS host,
                         max(last_seen_ns) AS x_seen, argMax(exit_reason, last_seen_ns) AS x_exit
                  FROM {db}.ranks GROUP BY job, rank)
            GROUP BY host),
          g AS (
            SELECT host, toInt64(count()) AS gpus, avg(dev_mean) AS gpu_util_mean,
                   min(dev_mean) AS gpu_util_min, max(dev_mean) AS gpu_util_max
            FROM (SELECT toString(host) AS host, device, avg(value) AS dev_mean
                  FROM {db}.hw_samples
                  WHERE metric = 'gpu_util' AND ts_ns >= {{since:Int64}}
                  GROUP BY host, device)
            GROUP BY host)
        SELECT host, ranks, live_ranks, jobs, gpus, gpu_util_mean, gpu_util_min, gpu_util_max, last_seen_ns
        FROM r LEFT JOIN g USING (host)
        ORDER BY host
    """
    params = {"live": now - int(live_within_s * 1e9), "since": now - int(window_s * 1e9)}
    df = store.query_df(sql, params, settings={"join_use_nulls": 1})
    if df.empty:
        return pd.DataFrame(columns=HOSTS_COLUMNS)
    df["gpus"] = df["gpus"].fillna(0).astype(int)
    for c in ("gpu_util_mean", "gpu_util_min", "gpu_util_max"):
        df[c] = pd.to_numeric(df[c], errors="coerce").round(1)
    df["jobs"] = df["jobs"].map(list)
    df["last_seen"] = as_datetime(df["last_seen_ns"])
    df["last_seen_age_s"] = ((now - df["last_seen_ns"]) / 1e9).round(1)
    return df[HOSTS_COLUMNS].reset_index(drop=True)


GPU_UTIL_COLUMNS = ["host", "device", "gpu", "t", "gpu_util"]


def gpu_util_series(store: Store, window_s: float = 900.0, bucket_s: int = 10,
                    now_ns: int | None = None, max_gpus: int = 0) -> pd.DataFrame:
    """Per-GPU utilisation over the last ``window_s`` seconds in ``bucket_s`` buckets (heatmap frame).

    Columns: host, device, gpu ("host/device"), t (UTC bucket start), gpu_util (mean percent). With
    ``max_gpus`` > 0, only the ``max_gpus`` GPUs with the lowest mean utilisation over the window
    (the ones to look at in a fleet of thousands; :func:`gpu_util_summary` gives the fleet's figures).
    """
    check_positive("window_s", window_s)
    check_positive("bucket_s", bucket_s)
    if max_gpus < 0:
        raise ValueError(f"max_gpus must be >= 0, got {max_gpus!r}")
    now = now_or_wall_ns(now_ns)
    db = store.database
    lowest = f"""
          AND (host, device) IN (
            SELECT host, device FROM {db}.hw_samples
            WHERE metric = 'gpu_util' AND ts_ns >= {{since:Int64}}
            GROUP BY host, device ORDER BY avg(value), host, device LIMIT {{max_gpus:UInt32}})""" if max_gpus else ""
    sql = f"""
        SELECT host, device, intDiv(ts_ns, {{b:Int64}}) * {{b:Int64}} AS t_ns, avg(value) AS gpu_util
        FROM {db}.hw_samples
        WHERE metric = 'gpu_util' AND ts_ns >= {{since:Int64}}{lowest}
        GROUP BY host, device, t_ns
        ORDER BY host, device, t_ns
    """
    df = store.query_df(sql, {"b": int(bucket_s * 1e9), "since": now - int(window_s * 1e9), "max_gpus": int(max_gpus)})
    if df.empty:
        return pd.DataFrame(columns=GPU_UTIL_COLUMNS)
    df["gpu"] = df["host"].astype(str) + "/" + df["device"].astype(str)
    df["t"] = as_datetime(df["t_ns"])
    df["gpu_util"] = df["gpu_util"].round(1)
    return df[GPU_UTIL_COLUMNS]


GPU_SUMMARY_COLUMNS = ["gpus", "gpu_util"]


def gpu_util_summary(store: Store, window_s: float = 900.0, now_ns: int | None = None) -> pd.DataFrame:
    """The fleet's GPUs that sent ``gpu_util`` in the last ``window_s`` seconds and the mean over
    every such sample: one row, :data:`GPU_SUMMARY_COLUMNS` (gpu_util NaN without samples)."""
    check_positive("window_s", window_s)
    now = now_or_wall_ns(now_ns)
    sql = f"""
        SELECT toInt64(uniqExact(host, device)) AS gpus, if(count() > 0, avg(value), nan) AS gpu_util
        FROM {store.database}.hw_samples
        WHERE metric = 'gpu_util' AND ts_ns >= {{since:Int64}}
    """
    df = store.query_df(sql, {"since": now - int(window_s * 1e9)})
    return df[GPU_SUMMARY_COLUMNS] if not df.empty else pd.DataFrame({"gpus": [0], "gpu_util": [float("nan")]})


# Hosts: hardware time series ------------------------------------------------------------------------

#: Bucket widths (s) that time-series queries pick from, so charts keep about ``points`` points.
BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
HW_COLUMNS = ["device", "metric", "t", "value"]
HW_LATEST_COLUMNS = ["device", "metric", "value", "age_s"]


def bucket_for(span_s: float, points: int = 240) -> int:
    """The smallest bucket of :data:`BUCKETS_S` that splits ``span_s`` seconds into <= ``points`` buckets."""
    check_positive("span_s", span_s)
    check_positive("points", points)
    for b in BUCKETS_S:
        if span_s / b <= points:
            return b
    return BUCKETS_S[-1]


def host_names(store: Store, since_ns: int = 0) -> list[str]:
    """Every host known from rank records or from hardware samples newer than ``since_ns``, sorted."""
    db = store.database
    sql = f"""
        SELECT DISTINCT h FROM (
          SELECT toString(host) AS h FROM {db}.ranks
          UNION ALL
          SELECT toString(host) AS h FROM {db}.hw_samples WHERE ts_ns >= {{since:Int64}})
        WHERE h != ''
        ORDER BY h
    """
    return [str(r[0]) for r in store.query_rows(sql, {"since": int(since_ns)})]


def hw_series(store: Store, host: str, since_ns: int, until_ns: int, metrics: list[str] | None = None,
              bucket_s: int | None = None) -> pd.DataFrame:
    """Hardware samples of one host between ``since_ns`` and ``until_ns``, averaged per time bucket.

    Columns: device (GPU index, -1 = the host itself), metric, t (UTC bucket start), value (mean over
    the bucket and over the ranks that reported it). ``bucket_s`` defaults to :func:`bucket_for` the
    span. ``metrics`` limits the metric names (default: all).
    """
    if until_ns <= since_ns:
        raise ValueError(f"until_ns must be > since_ns, got {since_ns}..{until_ns}")
    b = int(bucket_s or bucket_for((until_ns - since_ns) / 1e9))
    check_positive("bucket_s", b)
    db = store.database
    sql = f"""
        SELECT device, toString(metric) AS metric, intDiv(ts_ns, {{b:Int64}}) * {{b:Int64}} AS t_ns,
               avg(value) AS value
        FROM {db}.hw_samples
        WHERE host = {{host:String}} AND ts_ns >= {{since:Int64}} AND ts_ns < {{until:Int64}}
          AND ({{all:UInt8}} OR metric IN {{metrics:Array(String)}})
        GROUP BY device, metric, t_ns
        ORDER BY device, metric, t_ns
    """
    df = store.query_df(sql, {"host": host, "since": int(since_ns), "until": int(until_ns), "b": b * 10**9,
                              "all": int(metrics is None), "metrics": list(metrics or [])})
    if df.empty:
        return pd.DataFrame(columns=HW_COLUMNS)
    df["t"] = as_datetime(df["t_ns"])
    return df[HW_COLUMNS].reset_index(drop=True)


def hw_latest(store: Store, host: str, since_ns: int, now_ns: int | None = None) -> pd.DataFrame:
    """The newest value of each (device, metric) of one host since ``since_ns``: :data:`HW_LATEST_COLUMNS`."""
    db = store.database
    sql = f"""
        SELECT device, toString(metric) AS metric, argMax(value, ts_ns) AS last_value, max(ts_ns) AS last_ns
        FROM {db}.hw_samples
        WHERE host = {{host:String}} AND ts_ns >= {{since:Int64}}
        GROUP BY device, metric
        ORDER BY device, metric
    """
    df = store.query_df(sql, {"host": host, "since": int(since_ns)})
    if df.empty:
        return pd.DataFrame(columns=HW_LATEST_COLUMNS)
    df["age_s"] = ((now_or_wall_ns(now_ns) - df["last_ns"]) / 1e9).round(1)
    df = df.rename(columns={"last_value": "value"})
    return df[HW_LATEST_COLUMNS].reset_index(drop=True)
