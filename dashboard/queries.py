"""Every SQL statement the dashboard runs, as functions from a Store (and parameters) to DataFrames.

Contract shared by all functions here:

- They block until ClickHouse answers and raise :class:`storage.store.StoreError` on failure.
- Values are bound server-side with ClickHouse's ``{name:Type}`` parameters (chDB and the HTTP
  server both support them); nothing user-controlled is formatted into SQL. Only the database
  name (from the Store, not from the user) is interpolated.
- Times in arguments are Int64 nanoseconds since the Unix epoch; ``now_ns`` defaults to the wall
  clock so tests can pin it. Durations in results are milliseconds (``*_ms``) or seconds (``*_s``).
- Tables are ReplacingMergeTree, so "latest" values use ``argMax(..., version/time)`` or
  ``LIMIT 1 BY``; merges never need to have happened for the answers to be exact.
- An empty result is an empty DataFrame with the documented columns.
- The SQL console (:func:`run_readonly`, from storage/readonly.py) is the one place here where
  user-written SQL runs: checked by :func:`check_readonly_sql` (rankscope/sql_guard.py), then run
  with ``readonly=1`` and result/time limits on a session of its own.

No Streamlit here: the pages own caching and rendering.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import pandas as pd

from rankscope.sql_guard import DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT_S
from rankscope.sql_guard import READONLY_STATEMENTS as READONLY_STATEMENTS
from rankscope.sql_guard import SqlRefused as SqlRefused
from rankscope.sql_guard import check_readonly_sql as check_readonly_sql
from rankscope.sql_guard import readonly_settings as readonly_settings
from storage.readonly import SqlResult as SqlResult
from storage.readonly import _session
from storage.readonly import run_readonly as run_readonly
from storage.store import Store
from storage.store import StoreError as StoreError

#: Rank states, most severe first. ``derive_rank_states`` picks the first that applies.
RANK_STATES = ("exited", "dead", "hung", "slow", "running")
#: Worker-stats states (written by the processors) that map onto a rank state.
_STATS_STATE_MAP = {"slow": "slow", "straggler": "slow", "hung": "hung", "stalled": "hung", "dead": "dead"}
#: Above this many ranks the step-time chart becomes a rank x step heatmap.
HEATMAP_MIN_RANKS = 64


def _now(now_ns: int | None) -> int:
    return time.time_ns() if now_ns is None else int(now_ns)


def _ts(ns: pd.Series) -> pd.Series:
    """Int64 ns -> tz-aware UTC timestamps; 0 (never) becomes NaT."""
    ns = ns.fillna(0).astype("int64")
    return pd.to_datetime(ns, unit="ns", utc=True).where(ns > 0)


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


# Jobs -------------------------------------------------------------------------------------------

JOBS_COLUMNS = ["job", "world_size", "ranks_seen", "last_step", "first_seen", "last_seen",
                "last_seen_age_s", "open_alerts", "alerts_total"]


def jobs(store: Store, now_ns: int | None = None, limit: int = 1000) -> pd.DataFrame:
    """One row per job, most recently seen first.

    Columns: job, world_size (declared; falls back to ranks seen), ranks_seen, last_step (max over
    ranks), first_seen / last_seen (UTC timestamps), last_seen_age_s, open_alerts, alerts_total.
    Jobs known only from the ``jobs`` table or only from ``ranks`` both appear.
    """
    _check_positive("limit", limit)
    db = store.database
    sql = f"""
        WITH
          r AS (
            SELECT job, max(rw) AS r_world, uniqExact(rank) AS ranks_seen,
                   max(rstep) AS last_step, max(rseen) AS r_last, min(rfirst) AS r_first
            FROM (
              SELECT job, rank, argMax(world_size, last_seen_ns) AS rw,
                     argMax(last_step, last_seen_ns) AS rstep, max(last_seen_ns) AS rseen,
                     min(last_seen_ns) AS rfirst
              FROM {db}.ranks GROUP BY job, rank)
            GROUP BY job),
          j AS (
            SELECT job, argMax(world_size, last_seen_ns) AS j_world, min(first_seen_ns) AS j_first,
                   max(last_seen_ns) AS j_last
            FROM {db}.jobs GROUP BY job),
          a AS (
            SELECT job, countIf(st != 'resolved') AS open_alerts, count() AS alerts_total
            FROM (SELECT job, alert_id, argMax(status, version) AS st
                  FROM {db}.alerts GROUP BY job, alert_id)
            GROUP BY job)
        SELECT job,
               toInt64(greatest(j_world, r_world)) AS world_size,
               toInt64(ranks_seen) AS ranks_seen,
               toInt64(last_step) AS last_step,
               if(j_first > 0 AND (r_first = 0 OR j_first < r_first), j_first, r_first) AS first_seen_ns,
               greatest(j_last, r_last) AS last_seen_ns,
               toInt64(open_alerts) AS open_alerts,
               toInt64(alerts_total) AS alerts_total
        FROM j FULL OUTER JOIN r USING (job)
        LEFT JOIN a USING (job)
        ORDER BY open_alerts > 0 DESC, last_seen_ns DESC, job
        LIMIT {{limit:UInt32}}
    """
    df = store.query_df(sql, {"limit": int(limit)})
    if df.empty:
        return pd.DataFrame(columns=JOBS_COLUMNS)
    now = _now(now_ns)
    df["world_size"] = df["world_size"].where(df["world_size"] > 0, df["ranks_seen"])
    df["first_seen"] = _ts(df["first_seen_ns"])
    df["last_seen"] = _ts(df["last_seen_ns"])
    df["last_seen_age_s"] = ((now - df["last_seen_ns"]) / 1e9).round(1)
    return df[JOBS_COLUMNS].reset_index(drop=True)


# Ranks of a job ---------------------------------------------------------------------------------

RANKS_COLUMNS = ["rank", "state", "host", "pid", "local_rank", "last_step", "median_step_ms",
                 "median_busy_ms", "median_comm_ms", "busy_z", "heartbeat_age_s", "since_step_s",
                 "dropped", "alerts", "exit_reason", "exit_detail"]


def rank_rows(store: Store, job: str, recent_steps: int = 50, now_ns: int | None = None) -> pd.DataFrame:
    """Raw per-rank facts of one job (no state yet): identity, progress, recent medians, heartbeat.

    Medians are over each rank's last ``recent_steps`` steps. ``heartbeat_age_s`` is the time since
    the newest of the rank's last heartbeat and its last ``ranks`` update; ``stats_state`` is the
    newest ``worker_stats.state`` ('' when the processors wrote none).
    """
    _check_positive("recent_steps", recent_steps)
    db = store.database
    sql = f"""
        WITH
          r AS (
            SELECT rank, argMax(host, last_seen_ns) AS r_host, argMax(pid, last_seen_ns) AS r_pid,
                   argMax(local_rank, last_seen_ns) AS r_local,
                   argMax(last_step, last_seen_ns) AS r_step, max(last_seen_ns) AS r_seen,
                   argMax(exit_reason, last_seen_ns) AS r_exit,
                   argMax(exit_detail, last_seen_ns) AS r_detail
            FROM {db}.ranks WHERE job = {{job:String}} GROUP BY rank),
          m AS (
            SELECT rank, max(step) AS m_step FROM {db}.steps WHERE job = {{job:String}} GROUP BY rank),
          s AS (
            SELECT rank, max(step) AS s_step, max(end_ns) AS s_end,
                   quantileExact(0.5)(duration_ns) AS med_step_ns,
                   quantileExact(0.5)(busy_ns) AS med_busy_ns,
                   quantileExact(0.5)(comm_ns) AS med_comm_ns,
                   any(host) AS s_host, any(pid) AS s_pid
            FROM (SELECT rank, step, end_ns, duration_ns, busy_ns, comm_ns, host, pid
                  FROM {db}.steps
                  WHERE job = {{job:String}}
                    -- every rank's last n steps lie above the slowest rank's last step - n; this
                    -- bound lets the primary key skip the older granules before LIMIT BY sorts
                    AND step > (SELECT min(m_step) FROM m) - {{n:UInt32}}
                  ORDER BY rank, step DESC LIMIT {{n:UInt32}} BY rank)
            GROUP BY rank),
          h AS (
            SELECT rank, max(ts_ns) AS hb_ns, argMax(since_step_s, ts_ns) AS hb_since,
                   argMax(dropped, ts_ns) AS hb_dropped, argMax(step, ts_ns) AS hb_step
            FROM {db}.heartbeats WHERE job = {{job:String}} GROUP BY rank),
          w AS (
            SELECT rank, argMax(state, ts_ns) AS w_state, argMax(busy_z, ts_ns) AS w_z
            FROM {db}.worker_stats WHERE job = {{job:String}} GROUP BY rank)
        SELECT rank,
               if(r_host != '', toString(r_host), toString(s_host)) AS host,
               if(r_pid != 0, r_pid, s_pid) AS pid,
               r_local AS local_rank,
               greatest(r_step, s_step, hb_step) AS last_step,
               greatest(r_seen, s_end, hb_ns) AS seen_ns,
               med_step_ns, med_busy_ns, med_comm_ns, w_z AS busy_z, hb_since AS since_step_s,
               hb_dropped AS dropped, toString(w_state) AS stats_state,
               toString(r_exit) AS exit_reason, r_detail AS exit_detail
        FROM r FULL OUTER JOIN s USING (rank)
        LEFT JOIN h USING (rank)
        LEFT JOIN w USING (rank)
        ORDER BY rank
    """
    df = store.query_df(sql, {"job": job, "n": int(recent_steps)})
    if df.empty:
        return df
    now = _now(now_ns)
    df["heartbeat_age_s"] = ((now - df["seen_ns"]) / 1e9).round(1)
    for c in ("step", "busy", "comm"):
        df[f"median_{c}_ms"] = (df[f"med_{c}_ns"].astype(float) / 1e6).round(2)
    df["busy_z"] = df["busy_z"].astype(float).round(2)
    return df


def derive_rank_states(rows: pd.DataFrame, open_alerts: pd.DataFrame,
                       dead_after_s: float = 6.0) -> pd.DataFrame:
    """Add ``state`` and ``alerts`` to :func:`rank_rows` output. Pure; no I/O.

    Steps, first match wins (most severe first):
      1. ``exited``: the rank sent an exit record (normal end, exception or signal).
      2. ``dead``: an open ``dead_rank`` alert names it, or no heartbeat for ``dead_after_s``.
      3. ``hung``: an open ``hang`` alert names it as a culprit, or the processors say so.
      4. ``slow``: an open ``slow_rank`` alert names it, or the processors' state is slow.
      5. ``running`` otherwise.
    """
    _check_positive("dead_after_s", dead_after_s)
    df = rows.copy()
    if df.empty:
        return pd.DataFrame(columns=RANKS_COLUMNS)
    named: dict[str, set[int]] = {"dead_rank": set(), "hang": set(), "slow_rank": set()}
    per_rank: dict[int, list[str]] = {}
    if not open_alerts.empty:
        for kind, ranks in zip(open_alerts["kind"], open_alerts["ranks"], strict=True):
            for r in ranks:
                named.setdefault(kind, set()).add(int(r))
                per_rank.setdefault(int(r), []).append(kind)

    def state(row: Any) -> str:
        rank = int(row["rank"])
        stats = _STATS_STATE_MAP.get(str(row.get("stats_state") or ""), "")
        if row.get("exit_reason"):
            return "exited"
        if rank in named["dead_rank"] or stats == "dead" or row["heartbeat_age_s"] > dead_after_s:
            return "dead"
        if rank in named["hang"] or stats == "hung":
            return "hung"
        if rank in named["slow_rank"] or stats == "slow":
            return "slow"
        return "running"

    df["state"] = df.apply(state, axis=1)
    df["alerts"] = [", ".join(sorted(set(per_rank.get(int(r), [])))) for r in df["rank"]]
    for c in RANKS_COLUMNS:
        if c not in df.columns:
            df[c] = None
    return df[RANKS_COLUMNS].reset_index(drop=True)


def ranks(store: Store, job: str, recent_steps: int = 50, dead_after_s: float = 6.0,
          now_ns: int | None = None) -> pd.DataFrame:
    """The ranks table of a job: :data:`RANKS_COLUMNS`, one row per rank, ordered by rank."""
    rows = rank_rows(store, job, recent_steps=recent_steps, now_ns=now_ns)
    open_ = alerts(store, job=job, include_resolved=False, now_ns=now_ns)
    return derive_rank_states(rows, open_, dead_after_s=dead_after_s)


# Step times -------------------------------------------------------------------------------------

STEP_COLUMNS = ["rank", "step", "step_ms", "busy_ms", "comm_ms"]


def step_times(store: Store, job: str, last_n: int = 200) -> pd.DataFrame:
    """Per-rank step times over the job's last ``last_n`` steps (long format, for a line chart).

    Columns: rank, step, step_ms (wall), busy_ms (step minus collective wait), comm_ms.
    """
    _check_positive("last_n", last_n)
    db = store.database
    sql = f"""
        SELECT rank, step, max(duration_ns) / 1e6 AS step_ms, max(busy_ns) / 1e6 AS busy_ms,
               max(comm_ns) / 1e6 AS comm_ms
        FROM {db}.steps
        WHERE job = {{job:String}}
          AND step > (SELECT max(step) FROM {db}.steps WHERE job = {{job:String}}) - {{n:Int64}}
        GROUP BY rank, step
        ORDER BY rank, step
    """
    df = store.query_df(sql, {"job": job, "n": int(last_n)})
    return df if not df.empty else pd.DataFrame(columns=STEP_COLUMNS)


FLIGHT_COLUMNS = ["rank", "sent", "request_id", "reason", "steps", "first_step", "last_step", "stacks"]


def flight_records(store: Store, job: str, limit: int = 64) -> pd.DataFrame:
    """The latest flight-recorder dump of each rank of a job (:data:`FLIGHT_COLUMNS`, by rank).

    ``steps`` = step records in the dump; ``first_step``/``last_step`` their range (-1 if none);
    ``stacks`` = the dump's thread stacks as a list of ``{"thread", "frames"}`` (outermost first).
    """
    _check_positive("limit", limit)
    sql = f"""
        SELECT rank, max(ts_ns) AS last_ns, argMax(request_id, ts_ns) AS req,
               argMax(reason, ts_ns) AS why, argMax(steps, ts_ns) AS step_json, argMax(stacks, ts_ns) AS stack_json
        FROM {store.database}.flight_records
        WHERE job = {{job:String}}
        GROUP BY rank ORDER BY rank LIMIT {{n:Int64}}
    """
    df = store.query_df(sql, {"job": job, "n": int(limit)})
    if df.empty:
        return pd.DataFrame(columns=FLIGHT_COLUMNS)

    def parse(text: str) -> list[Any]:
        try:
            v = json.loads(text) if text else []
        except ValueError:
            return []
        return v if isinstance(v, list) else []

    steps = df["step_json"].map(parse)
    return pd.DataFrame({
        "rank": df["rank"].astype(int), "sent": _ts(df["last_ns"]), "request_id": df["req"],
        "reason": df["why"], "steps": steps.map(len),
        "first_step": steps.map(lambda s: int(s[0][0]) if s and isinstance(s[0], list) and s[0] else -1),
        "last_step": steps.map(lambda s: int(s[-1][0]) if s and isinstance(s[-1], list) and s[-1] else -1),
        "stacks": df["stack_json"].map(parse)})[FLIGHT_COLUMNS]


HEATMAP_METRICS = {"step_ms": "duration_ns", "busy_ms": "busy_ns", "comm_ms": "comm_ns"}


def step_time_heatmap(store: Store, job: str, metric: str = "step_ms", last_n: int = 400,
                      max_cols: int = 100) -> pd.DataFrame:
    """Rank x step heatmap frame for large jobs: median ``metric`` per rank and bin of steps.

    ``metric`` is one of :data:`HEATMAP_METRICS` (step_ms, busy_ms, comm_ms). Steps are binned so
    that at most ``max_cols`` columns come back; ``step`` is the first step of its bin. Long
    format: rank, step, <metric>.
    """
    if metric not in HEATMAP_METRICS:
        raise ValueError(f"metric must be one of {sorted(HEATMAP_METRICS)}, got {metric!r}")
    _check_positive("last_n", last_n)
    _check_positive("max_cols", max_cols)
    width = max(1, -(-int(last_n) // int(max_cols)))
    db = store.database
    sql = f"""
        SELECT rank, intDiv(step, {{w:UInt32}}) * {{w:UInt32}} AS step_bin,
               quantile(0.5)({HEATMAP_METRICS[metric]}) / 1e6 AS value
        FROM {db}.steps
        WHERE job = {{job:String}}
          AND step > (SELECT max(step) FROM {db}.steps WHERE job = {{job:String}}) - {{n:Int64}}
        GROUP BY rank, step_bin
        ORDER BY rank, step_bin
    """
    df = store.query_df(sql, {"job": job, "n": int(last_n), "w": width})
    df = df.rename(columns={"step_bin": "step", "value": metric})
    return df if not df.empty else pd.DataFrame(columns=["rank", "step", metric])


# Alerts -----------------------------------------------------------------------------------------

ALERTS_COLUMNS = ["alert_id", "job", "kind", "status", "open", "severity", "ranks", "step", "opened",
                  "updated", "resolved", "duration_s", "version", "summary", "lost_rank_seconds", "body"]


def alerts(store: Store, job: str | None = None, include_resolved: bool = True, limit: int = 500,
           now_ns: int | None = None) -> pd.DataFrame:
    """The latest version of each alert (of one job, or all jobs when ``job`` is None).

    Open alerts first, then newest first. ``open`` is ``status != 'resolved'``; ``duration_s`` runs
    from opening to resolution (or to ``now_ns`` while open). ``body`` is the alert's JSON.
    """
    _check_positive("limit", limit)
    db = store.database
    sql = f"""
        SELECT alert_id, job, kind, status, severity, ranks, step, opened_ns, updated_ns, resolved_ns,
               version, summary, lost_rank_seconds, body
        FROM (SELECT * FROM {db}.alerts
              WHERE ({{job:String}} = '' OR job = {{job:String}})
              ORDER BY version DESC LIMIT 1 BY job, alert_id)
        WHERE {{all:UInt8}} OR status != 'resolved'
        ORDER BY status = 'resolved', updated_ns DESC
        LIMIT {{limit:UInt32}}
    """
    df = store.query_df(sql, {"job": job or "", "all": int(include_resolved), "limit": int(limit)})
    if df.empty:
        return pd.DataFrame(columns=ALERTS_COLUMNS)
    now = _now(now_ns)
    df["open"] = df["status"] != "resolved"
    end = df["resolved_ns"].where(~df["open"] & (df["resolved_ns"] > 0), now)
    df["duration_s"] = ((end - df["opened_ns"]) / 1e9).clip(lower=0).round(1)
    df["opened"] = _ts(df["opened_ns"])
    df["updated"] = _ts(df["updated_ns"])
    df["resolved"] = _ts(df["resolved_ns"])
    df["ranks"] = df["ranks"].map(lambda r: [int(x) for x in r])
    return df[ALERTS_COLUMNS].reset_index(drop=True)


STACK_COLUMNS = ["alert_id", "group", "ranks", "thread", "frames", "waiting_in_collective", "culprit"]


def parse_stack_groups(alerts_df: pd.DataFrame) -> pd.DataFrame:
    """Explode the ``stack_groups`` of each alert's JSON body into rows. Pure; no I/O.

    ``frames`` is a list of "file:line func", outermost first. ``culprit`` is True when the group
    holds one of the alert's culprit ranks. Bodies that are not JSON or lack groups add no rows.
    """
    out: list[dict[str, Any]] = []
    for alert_id, culprits, body in zip(alerts_df.get("alert_id", []), alerts_df.get("ranks", []),
                                        alerts_df.get("body", []), strict=True):
        try:
            groups = json.loads(body or "{}").get("stack_groups") or []
        except (ValueError, AttributeError):
            continue
        for i, g in enumerate(groups):
            if not isinstance(g, dict):
                continue
            gr = [int(r) for r in g.get("ranks") or []]
            out.append({"alert_id": alert_id, "group": i, "ranks": gr, "thread": str(g.get("thread", "")),
                        "frames": [str(f) for f in g.get("frames") or []],
                        "waiting_in_collective": bool(g.get("waiting_in_collective", False)),
                        "culprit": bool(set(gr) & {int(c) for c in culprits})})
    return pd.DataFrame(out, columns=STACK_COLUMNS)


def alert_stack_groups(store: Store, job: str | None = None, include_resolved: bool = True) -> pd.DataFrame:
    """Stack groups of the alerts of a job (or all jobs): :data:`STACK_COLUMNS`."""
    return parse_stack_groups(alerts(store, job=job, include_resolved=include_resolved))


LOST_COLUMNS = ["alert_id", "job", "kind", "status", "ranks", "step", "duration_s", "lost_rank_seconds",
                "estimated"]


def lost_time(alerts_df: pd.DataFrame, world_sizes: dict[str, int]) -> pd.DataFrame:
    """Lost rank-seconds per alert. Pure; no I/O.

    The processors' own estimate wins when present. Otherwise a hang or dead rank stalls the whole
    job, so the estimate is world size x incident duration (``estimated`` is then True).
    """
    if alerts_df.empty:
        return pd.DataFrame(columns=LOST_COLUMNS)
    df = alerts_df.copy()
    reported = df["lost_rank_seconds"].astype(float)
    stall = df["kind"].isin(["hang", "dead_rank"]) & (reported <= 0)
    ws = df["job"].map(lambda j: max(1, int(world_sizes.get(j, 1) or 1)))
    df["lost_rank_seconds"] = reported.where(~stall, ws * df["duration_s"]).round(1)
    df["estimated"] = stall
    return df[LOST_COLUMNS].sort_values("lost_rank_seconds", ascending=False).reset_index(drop=True)


def lost_rank_seconds(store: Store, job: str | None = None, now_ns: int | None = None) -> pd.DataFrame:
    """Lost rank-seconds per alert of a job (or all jobs): :data:`LOST_COLUMNS`, costliest first."""
    al = alerts(store, job=job, now_ns=now_ns)
    js = jobs(store, now_ns=now_ns)
    return lost_time(al, dict(zip(js["job"], js["world_size"], strict=True)))


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
    _check_positive("window_s", window_s)
    _check_positive("live_within_s", live_within_s)
    now = _now(now_ns)
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
    df["last_seen"] = _ts(df["last_seen_ns"])
    df["last_seen_age_s"] = ((now - df["last_seen_ns"]) / 1e9).round(1)
    return df[HOSTS_COLUMNS].reset_index(drop=True)


GPU_UTIL_COLUMNS = ["host", "device", "gpu", "t", "gpu_util"]


def gpu_util_series(store: Store, window_s: float = 900.0, bucket_s: int = 10,
                    now_ns: int | None = None) -> pd.DataFrame:
    """Per-GPU utilisation over the last ``window_s`` seconds in ``bucket_s`` buckets (heatmap frame).

    Columns: host, device, gpu ("host/device"), t (UTC bucket start), gpu_util (mean percent).
    """
    _check_positive("window_s", window_s)
    _check_positive("bucket_s", bucket_s)
    now = _now(now_ns)
    db = store.database
    sql = f"""
        SELECT host, device, intDiv(ts_ns, {{b:Int64}}) * {{b:Int64}} AS t_ns, avg(value) AS gpu_util
        FROM {db}.hw_samples
        WHERE metric = 'gpu_util' AND ts_ns >= {{since:Int64}}
        GROUP BY host, device, t_ns
        ORDER BY host, device, t_ns
    """
    df = store.query_df(sql, {"b": int(bucket_s * 1e9), "since": now - int(window_s * 1e9)})
    if df.empty:
        return pd.DataFrame(columns=GPU_UTIL_COLUMNS)
    df["gpu"] = df["host"].astype(str) + "/" + df["device"].astype(str)
    df["t"] = _ts(df["t_ns"])
    df["gpu_util"] = df["gpu_util"].round(1)
    return df[GPU_UTIL_COLUMNS]


# Hosts: hardware time series ------------------------------------------------------------------------

#: Bucket widths (s) that time-series queries pick from, so charts keep about ``points`` points.
BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
HW_COLUMNS = ["device", "metric", "t", "value"]
HW_LATEST_COLUMNS = ["device", "metric", "value", "age_s"]


def bucket_for(span_s: float, points: int = 240) -> int:
    """The smallest bucket of :data:`BUCKETS_S` that splits ``span_s`` seconds into <= ``points`` buckets."""
    _check_positive("span_s", span_s)
    _check_positive("points", points)
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
    _check_positive("bucket_s", b)
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
    df["t"] = _ts(df["t_ns"])
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
    df["age_s"] = ((_now(now_ns) - df["last_ns"]) / 1e9).round(1)
    df = df.rename(columns={"last_value": "value"})
    return df[HW_LATEST_COLUMNS].reset_index(drop=True)


# Trace windows --------------------------------------------------------------------------------------

WINDOWS_COLUMNS = ["window_id", "request_id", "status", "ranks", "first_step", "last_step", "steps", "events",
                   "truncated_ranks", "start", "end", "duration_s", "updated"]
WINDOW_RANKS_COLUMNS = ["rank", "status", "first_step", "last_step", "events", "truncated", "start", "end"]
EVENT_COLUMNS = ["rank", "category", "name", "start_ns", "dur_ns", "device", "stream", "step", "bytes", "attrs"]
#: Most events one call reads (a window is capped by the ranks' byte budget; this guards the page).
MAX_EVENTS = 2_000_000


def trace_windows(store: Store, job: str, limit: int = 200) -> pd.DataFrame:
    """One row per trace window of a job (newest first), merged over its ranks: :data:`WINDOWS_COLUMNS`.

    ``status`` is the ranks' common status, or e.g. ``complete ×3, stopped ×1`` when they differ;
    ``steps`` is last - first + 1; ``truncated_ranks`` counts ranks whose events hit the byte budget.
    ``request_id`` is the window id without its ``-<k>`` counter.
    """
    _check_positive("limit", limit)
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
    df["start"], df["end"], df["updated"] = _ts(df["start_ns"]), _ts(df["end_ns"]), _ts(df["updated_ns"])
    df["duration_s"] = ((df["end_ns"] - df["start_ns"]).clip(lower=0) / 1e9).round(3)
    return df[WINDOWS_COLUMNS].reset_index(drop=True)


def _merge_statuses(statuses: Any) -> str:
    counts = pd.Series([str(s) for s in statuses]).value_counts()
    if len(counts) == 1:
        return str(counts.index[0])
    return ", ".join(f"{s} ×{n}" for s, n in counts.items())


def trace_window_ranks(store: Store, job: str, window_id: str) -> pd.DataFrame:
    """The per-rank rows of one window (latest version of each): :data:`WINDOW_RANKS_COLUMNS`."""
    db = store.database
    sql = f"""
        SELECT rank, toString(status) AS status, first_step, last_step, events, truncated = 1 AS truncated,
               start_ns, end_ns
        FROM {db}.trace_windows WHERE job = {{job:String}} AND window_id = {{w:String}}
        ORDER BY rank, updated_ns DESC LIMIT 1 BY rank
    """
    df = store.query_df(sql, {"job": job, "w": window_id})
    if df.empty:
        return pd.DataFrame(columns=WINDOW_RANKS_COLUMNS)
    df["truncated"] = df["truncated"].astype(bool)
    df["start"], df["end"] = _ts(df["start_ns"]), _ts(df["end_ns"])
    return df[WINDOW_RANKS_COLUMNS].reset_index(drop=True)


def trace_events(store: Store, job: str, window_id: str, ranks: list[int] | None = None,
                 categories: list[str] | None = None, limit: int = MAX_EVENTS) -> pd.DataFrame:
    """Raw events of one window (all ranks, or ``ranks``; all categories, or ``categories``), by start.

    Columns: :data:`EVENT_COLUMNS`; ``attrs`` is a dict. At most ``limit`` rows (earliest first).
    """
    _check_positive("limit", limit)
    db = store.database
    sql = f"""
        SELECT rank, toString(category) AS category, toString(name) AS name, start_ns, dur_ns, device, stream,
               step, bytes, attrs
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


# Reports --------------------------------------------------------------------------------------------

def window_python_paths(store: Store, job: str, window_id: str) -> pd.DataFrame:
    """Python call paths of a window's summaries with their self time: ``rank, category, name,
    exclusive_ns`` (``name`` is ``root;...;leaf``), for the folded-stack and speedscope exports."""
    db = store.database
    sql = f"""
        SELECT rank, toString(category) AS category, name, toInt64(sum(exclusive_ns)) AS exclusive_ns
        FROM {db}.function_summaries FINAL
        WHERE job = {{job:String}} AND window_id = {{w:String}} AND category = 'python'
        GROUP BY rank, category, name ORDER BY rank, name
    """
    df = store.query_df(sql, {"job": job, "w": window_id})
    return df if not df.empty else pd.DataFrame(columns=["rank", "category", "name", "exclusive_ns"])


REPORTS_COLUMNS = ["job", "window_id", "created", "created_ns", "body"]


def reports(store: Store, job: str | None = None, limit: int = 200) -> pd.DataFrame:
    """Diagnosis reports (latest per job and window), newest first: :data:`REPORTS_COLUMNS`."""
    _check_positive("limit", limit)
    db = store.database
    sql = f"""
        SELECT toString(job) AS job, window_id, created_ns, body
        FROM {db}.reports
        WHERE {{job:String}} = '' OR job = {{job:String}}
        ORDER BY created_ns DESC LIMIT 1 BY job, window_id
        LIMIT {{limit:UInt32}}
    """
    df = store.query_df(sql, {"job": job or "", "limit": int(limit)})
    if df.empty:
        return pd.DataFrame(columns=REPORTS_COLUMNS)
    df["created"] = _ts(df["created_ns"])
    return df[REPORTS_COLUMNS].reset_index(drop=True)


def report_headline(body: str | bytes | dict[str, Any]) -> str:
    """The verdict's headline of a report body (:func:`rankscope.report_view.verdict`), or what
    the body is when it holds no diagnosis. Pure; never raises."""
    from rankscope.report_view import diagnosis_of, verdict

    try:
        obj = body if isinstance(body, dict) else json.loads(body)
    except (TypeError, ValueError):
        return "not JSON"
    if not isinstance(obj, dict):
        return "not a report"
    if diagnosis_of(obj) is None:
        return "GPU time breakdown (no diagnosis)" if "temporal_breakdown" in obj else "no diagnosis"
    try:
        return verdict(obj).headline
    except (KeyError, TypeError, ValueError) as e:
        return f"unreadable diagnosis ({type(e).__name__}: {e})"


@dataclass(frozen=True)
class ReportSection:
    """One part of a report body: ``kind`` is ``table`` (a DataFrame), ``fields`` (a two-column
    DataFrame of name and value) or ``json`` (any JSON value that is neither)."""

    title: str
    kind: str
    data: Any


def report_sections(body: str | bytes | dict[str, Any]) -> list[ReportSection]:
    """Split a report's JSON body into renderable sections. Pure; never raises.

    Steps: 1. parse (a body that is not JSON becomes one ``json`` section holding the text);
    2. top-level scalars and lists of scalars gather into a first ``Summary`` fields section;
    3. a list of dicts becomes a table (nested values as JSON text); 4. a dict holding lists of
    dicts is split into sub-sections titled ``parent / key``; any other dict becomes fields.
    """
    if isinstance(body, dict):
        obj: Any = body
    else:
        try:
            obj = json.loads(body)
        except (TypeError, ValueError):
            return [ReportSection("Body (not JSON)", "json", body.decode(errors="replace")
                                  if isinstance(body, bytes) else str(body))]
    if not isinstance(obj, dict):
        return [ReportSection("Body", _kind(obj), _section_data(obj))]
    summary = {k: v for k, v in obj.items() if _scalarish(v)}
    out = [ReportSection("Summary", "fields", _fields(summary))] if summary else []
    for key, value in obj.items():
        if key not in summary:
            out.extend(_sections(str(key), value))
    return out


def _scalarish(v: Any) -> bool:
    return not isinstance(v, dict | list) or (isinstance(v, list) and all(not isinstance(x, dict | list) for x in v))


def _is_records(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _kind(v: Any) -> str:
    return "table" if _is_records(v) else "fields" if isinstance(v, dict) else "json"


def _cell(v: Any) -> Any:
    if isinstance(v, dict | list):
        return json.dumps(v, separators=(",", ":"))
    return v


def _section_data(v: Any) -> Any:
    if _is_records(v):
        return pd.DataFrame([{str(k): _cell(x) for k, x in r.items()} for r in v])
    if isinstance(v, dict):
        return _fields(v)
    return v


def _fields(d: dict[str, Any]) -> pd.DataFrame:
    return pd.DataFrame({"name": [str(k) for k in d],
                         "value": [", ".join(map(str, v)) if isinstance(v, list) else
                                   json.dumps(v) if isinstance(v, dict) else "" if v is None else str(v)
                                   for v in d.values()]})


def _sections(title: str, value: Any) -> list[ReportSection]:
    if isinstance(value, dict) and any(_is_records(v) or isinstance(v, dict) for v in value.values()):
        flat = {k: v for k, v in value.items() if _scalarish(v)}
        out = [ReportSection(title, "fields", _fields(flat))] if flat else []
        for k, v in value.items():
            if k not in flat:
                out.extend(_sections(f"{title} / {k}", v))
        return out
    if isinstance(value, list) and not value:
        return [ReportSection(title, "json", [])]
    return [ReportSection(title, _kind(value), _section_data(value))]


# SQL console ------------------------------------------------------------------------------------------

# The guard and the read-only run live below the dashboard (rankscope/sql_guard.py, storage/readonly.py),
# shared with ``rankscope sql`` and serve's query endpoint.
CONSOLE_MAX_ROWS = DEFAULT_MAX_ROWS
CONSOLE_TIMEOUT_S = DEFAULT_TIMEOUT_S
_console_client = _session


#: Saved console queries; ``{db}`` is the database name.
SQL_EXAMPLES = {
    "Slowest ranks by median busy time (last 10 min)": """\
SELECT job, rank, any(host) AS host, uniqExact(step) AS steps,
       round(quantile(0.5)(busy_ns) / 1e6, 1) AS median_busy_ms,
       round(quantile(0.5)(duration_ns) / 1e6, 1) AS median_step_ms
FROM {db}.steps
WHERE end_ns >= toUnixTimestamp64Nano(now64(9) - INTERVAL 10 MINUTE)
GROUP BY job, rank
ORDER BY median_busy_ms DESC
LIMIT 20""",
    "Open alerts": """\
SELECT job, alert_id, kind, severity, ranks, step, summary,
       fromUnixTimestamp64Nano(opened_ns) AS opened
FROM (SELECT * FROM {db}.alerts ORDER BY version DESC LIMIT 1 BY job, alert_id)
WHERE status != 'resolved'
ORDER BY opened DESC""",
    "Steps per second per rank (last 5 min)": """\
SELECT job, rank, uniqExact(step) AS steps, round(steps / 300, 2) AS steps_per_s, max(step) AS last_step
FROM {db}.steps
WHERE end_ns >= toUnixTimestamp64Nano(now64(9) - INTERVAL 5 MINUTE)
GROUP BY job, rank
ORDER BY job, steps_per_s""",
    "Top functions by exclusive time in the latest window": """\
WITH (SELECT argMax((job, window_id), end_ns) FROM {db}.trace_windows) AS latest
SELECT category, name, uniqExact(rank) AS ranks, sum(count) AS calls,
       round(sum(exclusive_ns) / 1e6, 2) AS exclusive_ms, round(sum(total_ns) / 1e6, 2) AS total_ms
FROM {db}.function_summaries FINAL
WHERE (job, window_id) = latest
GROUP BY category, name
ORDER BY exclusive_ms DESC
LIMIT 25""",
}


def table_columns(store: Store) -> pd.DataFrame:
    """Tables and columns of the rankscope database (for the console's schema list)."""
    sql = """
        SELECT table, name, type FROM system.columns
        WHERE database = {db:String} AND table != 'schema_migrations'
        ORDER BY table, position
    """
    return store.query_df(sql, {"db": store.database})
