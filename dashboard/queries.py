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

No Streamlit here: the pages own caching and rendering.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pandas as pd

from storage.store import Store

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
          s AS (
            SELECT rank, max(step) AS s_step, max(end_ns) AS s_end,
                   quantileExact(0.5)(duration_ns) AS med_step_ns,
                   quantileExact(0.5)(busy_ns) AS med_busy_ns,
                   quantileExact(0.5)(comm_ns) AS med_comm_ns,
                   any(host) AS s_host, any(pid) AS s_pid
            FROM (SELECT rank, step, end_ns, duration_ns, busy_ns, comm_ns, host, pid
                  FROM {db}.steps WHERE job = {{job:String}}
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
