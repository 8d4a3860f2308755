"""Jobs, the ranks of a job and their states, step times and step histories."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from rankscope.dashboard.queries.alerts import alerts, lost_time
from rankscope.dashboard.queries.common import as_datetime, check_positive, now_or_wall_ns
from rankscope.last_arrivals import Step
from rankscope.last_arrivals import slow_watch as last_arrivals_slow_watch
from rankscope.rank_states import DEAD, EXITED, HUNG, RUNNING, SLOW, WAITING, base_state
from rankscope.sql_guard import READONLY_STATEMENTS as READONLY_STATEMENTS
from rankscope.sql_guard import SqlRefused as SqlRefused
from rankscope.sql_guard import check_readonly_sql as check_readonly_sql
from rankscope.sql_guard import readonly_settings as readonly_settings
from rankscope.storage.readonly import SqlResult as SqlResult
from rankscope.storage.readonly import run_readonly as run_readonly
from rankscope.storage.store import Store
from rankscope.storage.store import StoreError as StoreError

# Jobs -------------------------------------------------------------------------------------------

JOBS_COLUMNS = ["job", "world_size", "ranks_seen", "last_step", "first_seen", "last_seen",
                "last_seen_age_s", "open_alerts", "alerts_total"]


def jobs(store: Store, now_ns: int | None = None, limit: int = 1000) -> pd.DataFrame:
    """One row per job, most recently seen first.

    Columns: job, world_size (declared; falls back to ranks seen), ranks_seen, last_step (max over
    ranks), first_seen / last_seen (UTC timestamps), last_seen_age_s, open_alerts, alerts_total.
    Jobs known only from the ``jobs`` table or only from ``ranks`` both appear.
    """
    check_positive("limit", limit)
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
    now = now_or_wall_ns(now_ns)
    df["world_size"] = df["world_size"].where(df["world_size"] > 0, df["ranks_seen"])
    df["first_seen"] = as_datetime(df["first_seen_ns"])
    df["last_seen"] = as_datetime(df["last_seen_ns"])
    df["last_seen_age_s"] = ((now - df["last_seen_ns"]) / 1e9).round(1)
    return df[JOBS_COLUMNS].reset_index(drop=True)


# Ranks of a job ---------------------------------------------------------------------------------

RANKS_COLUMNS = ["rank", "state", "host", "pid", "local_rank", "last_step", "median_step_ms",
                 "median_busy_ms", "median_comm_ms", "busy_z", "cpu_wait_pct", "heartbeat_age_s", "since_step_s",
                 "dropped", "alerts", "exit_reason", "exit_detail"]


def rank_rows(store: Store, job: str, recent_steps: int = 50, now_ns: int | None = None) -> pd.DataFrame:
    """Raw per-rank facts of one job (no state yet): identity, progress, recent medians, heartbeat.

    Medians are over each rank's last ``recent_steps`` step numbers (its steps above its last step
    minus ``recent_steps``). ``heartbeat_age_s`` is the time since
    the newest of the rank's last heartbeat and its last ``ranks`` update; ``cpu_wait_pct`` the newest
    share of the time its training thread was ready to run in its last 30 s that it waited for a CPU (NaN unknown); ``stats_state`` is the
    newest ``worker_stats.state`` ('' when the processors wrote none).
    """
    check_positive("recent_steps", recent_steps)
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
                   quantileExactIf(0.5)(duration_ns, step > top - {{n:UInt32}}) AS med_step_ns,
                   quantileExactIf(0.5)(busy_ns, step > top - {{n:UInt32}}) AS med_busy_ns,
                   quantileExactIf(0.5)(comm_ns, step > top - {{n:UInt32}}) AS med_comm_ns,
                   any(host) AS s_host, any(pid) AS s_pid
            FROM (SELECT rank, step, end_ns, duration_ns, busy_ns, comm_ns, host, pid,
                         max(step) OVER (PARTITION BY rank) AS top
                  FROM {db}.steps
                  WHERE job = {{job:String}}
                    -- every rank's last n steps lie above the slowest rank's last step - n; this
                    -- bound lets the primary key skip the older granules
                    AND step > (SELECT min(m_step) FROM m) - {{n:UInt32}})
            GROUP BY rank),
          h AS (
            SELECT rank, max(ts_ns) AS hb_ns, argMax(since_step_s, ts_ns) AS hb_since,
                   argMax(dropped, ts_ns) AS hb_dropped, argMax(step, ts_ns) AS hb_step
            FROM {db}.heartbeats WHERE job = {{job:String}} GROUP BY rank),
          w AS (
            SELECT rank, argMax(state, ts_ns) AS w_state, argMax(busy_z, ts_ns) AS w_z,
                   argMax(cpu_wait_share, ts_ns) AS w_cpu_wait
            FROM {db}.worker_stats WHERE job = {{job:String}} GROUP BY rank)
        SELECT rank,
               if(r_host != '', toString(r_host), toString(s_host)) AS host,
               if(r_pid != 0, r_pid, s_pid) AS pid,
               r_local AS local_rank,
               greatest(r_step, s_step, hb_step) AS last_step,
               greatest(r_seen, s_end, hb_ns) AS seen_ns,
               med_step_ns, med_busy_ns, med_comm_ns, w_z AS busy_z,
               if(w_state = '', -1, w_cpu_wait) AS cpu_wait_share,   -- -1: no stats row (a LEFT JOIN's 0)
               hb_since AS since_step_s,
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
    now = now_or_wall_ns(now_ns)
    df["heartbeat_age_s"] = ((now - df["seen_ns"]) / 1e9).round(1)
    for c in ("step", "busy", "comm"):
        df[f"median_{c}_ms"] = (df[f"med_{c}_ns"].astype(float) / 1e6).round(2)
    df["busy_z"] = df["busy_z"].astype(float).round(2)
    wait = df["cpu_wait_share"].astype(float)
    df["cpu_wait_pct"] = (wait * 100).round(1).where(wait >= 0)     # unknown (-1, or no stats row): NaN
    return df


def derive_rank_states(rows: pd.DataFrame, open_alerts: pd.DataFrame,
                       dead_after_s: float = 6.0, watched_slow: set[int] | None = None) -> pd.DataFrame:
    """Add ``state`` and ``alerts`` to :func:`rank_rows` output. Pure; no I/O.

    Steps, first match wins (most severe first):
      1. ``exited``: the rank sent an exit record (normal end, exception or signal).
      2. ``dead``: an open ``dead_rank`` alert names it, or no heartbeat for ``dead_after_s``.
      3. ``hung``: an open ``hang`` alert names it as a culprit, or the processors say so.
      4. ``slow``: an open ``slow_rank`` alert names it, the processors' state is slow, or it is in
         ``watched_slow`` (a straggler below the alert's cost gate).
      5. ``waiting``: the processors' state: no step for longer than the hang threshold (a rank
         blocked in a collective for a peer).
      6. ``running`` otherwise.
    The states are :data:`rankscope.rank_states.RANK_STATES`.
    """
    check_positive("dead_after_s", dead_after_s)
    df = rows.copy()
    if df.empty:
        return pd.DataFrame(columns=RANKS_COLUMNS)
    watched = watched_slow or set()
    named: dict[str, set[int]] = {"dead_rank": set(), "hang": set(), "slow_rank": set()}
    per_rank: dict[int, list[str]] = {}
    if not open_alerts.empty:
        for kind, ranks in zip(open_alerts["kind"], open_alerts["ranks"], strict=True):
            for r in ranks:
                named.setdefault(kind, set()).add(int(r))
                per_rank.setdefault(int(r), []).append(kind)

    # The steps above, over whole columns (a 10,000-rank job's table in milliseconds).
    rank = df["rank"].astype(int)
    stats = (df["stats_state"] if "stats_state" in df.columns else pd.Series("", index=df.index)).map(base_state)
    exited = (df["exit_reason"] if "exit_reason" in df.columns else pd.Series("", index=df.index)).map(bool)
    stale = pd.to_numeric(df["heartbeat_age_s"], errors="coerce").gt(dead_after_s)
    conditions = [exited.to_numpy(dtype=bool),
                  (rank.isin(named["dead_rank"]) | (stats == DEAD) | stale).to_numpy(dtype=bool),
                  (rank.isin(named["hang"]) | (stats == HUNG)).to_numpy(dtype=bool),
                  (rank.isin(named["slow_rank"]) | (stats == SLOW) | rank.isin(watched)).to_numpy(dtype=bool),
                  (stats == WAITING).to_numpy(dtype=bool)]
    df["state"] = np.select(conditions, [EXITED, DEAD, HUNG, SLOW, WAITING], default=RUNNING)
    df["alerts"] = [", ".join(sorted(set(per_rank.get(int(r), [])))) for r in df["rank"]]
    for c in RANKS_COLUMNS:
        if c not in df.columns:
            df[c] = None
    return df[RANKS_COLUMNS].reset_index(drop=True)


def ranks(store: Store, job: str, recent_steps: int = 50, dead_after_s: float = 6.0,
          now_ns: int | None = None, slow_min_s: float = 10.0, slow_min_steps: int = 20) -> pd.DataFrame:
    """The ranks table of a job: :data:`RANKS_COLUMNS`, one row per rank, ordered by rank. A rank is
    ``slow`` also when it is a straggler below the processors' cost gate (:func:`slow_watch` over
    ``slow_min_s`` / ``slow_min_steps``, the processors' ``straggler_min_s`` / ``straggler_min_slow_steps``)."""
    rows = rank_rows(store, job, recent_steps=recent_steps, now_ns=now_ns)
    open_ = alerts(store, job=job, include_resolved=False, now_ns=now_ns)
    watched = set(slow_watch(store, job, len(rows), slow_min_s, slow_min_steps)) if len(rows) >= 3 else set()
    return derive_rank_states(rows, open_, dead_after_s=dead_after_s, watched_slow=watched)


RANK_SPAN = 2 ** 32   # ranks are below it: arrival * RANK_SPAN + rank orders by arrival, then rank


def slow_watch(store: Store, job: str, n_ranks: int, min_s: float = 10.0, min_steps: int = 20,
               max_steps: int = 400) -> dict[int, tuple[float, float]]:
    """Ranks that arrive last at the job's collectives often enough to be slow, over its newest
    complete steps (at most ``max_steps``): rank -> (last share, cost share), as the processors'
    slow-rank rule judges them (rankscope/last_arrivals.py), alerted or not."""
    check_positive("min_s", min_s)
    if n_ranks < 3:
        return {}
    return last_arrivals_slow_watch(last_arrival_steps(store, job, n_ranks, max_steps), n_ranks, min_s, min_steps)


def last_arrival_steps(store: Store, job: str, n_ranks: int, max_steps: int = 400) -> list[Step]:
    """The job's newest complete steps (at most ``max_steps``), oldest first, each with its last
    arrival: what rankscope.last_arrivals.steps_from_records makes of the stored step records."""
    db = store.database
    # Each complete step's two last arrivals (arrival = end - collective wait), reduced in the store as
    # rankscope.last_arrivals.steps_from_records reduces records: latest arrival first, the higher
    # rank first among equal ones. Each record's (arrival, rank) is one number, arrival * 2^32 + rank,
    # whose two largest a step keeps: ~3x cheaper than keeping tuples. FINAL drops re-inserted rows;
    # a job of 10,000 ranks returns its steps, not its records.
    sql = f"""
        SELECT step, toInt64(count()) AS n, groupArraySorted(2)(-key) AS last_two, argMax(dur, key) AS last_dur
        FROM (SELECT step, toInt128(end_ns - greatest(0, comm_ns)) * {RANK_SPAN} + rank AS key,
                     greatest(0, end_ns - start_ns) AS dur
              FROM {db}.steps FINAL
              WHERE job = {{job:String}} AND step > (
                  SELECT max(step) FROM {db}.steps WHERE job = {{job:String}}) - {{max_steps:Int64}})
        GROUP BY step ORDER BY step
    """
    rows = store.query_rows(sql, {"job": job, "max_steps": int(max_steps)})
    steps = []
    for step, n, last_two, dur in rows:
        if int(n) < max(2, n_ranks) or len(last_two) < 2:
            continue
        (a, r), second = divmod(-int(last_two[0]), RANK_SPAN), -int(last_two[1]) // RANK_SPAN
        steps.append(Step(int(step), r, max(0, a - second), int(dur), a))
    return steps


# Step times -------------------------------------------------------------------------------------

STEP_COLUMNS = ["rank", "step", "step_ms", "busy_ms", "comm_ms"]


def step_times(store: Store, job: str, last_n: int = 200) -> pd.DataFrame:
    """Per-rank step times over the job's last ``last_n`` steps (long format, for a line chart).

    Columns: rank, step, step_ms (wall), busy_ms (step minus collective wait), comm_ms.
    """
    check_positive("last_n", last_n)
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
    check_positive("limit", limit)
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
        "rank": df["rank"].astype(int), "sent": as_datetime(df["last_ns"]), "request_id": df["req"],
        "reason": df["why"], "steps": steps.map(len),
        "first_step": steps.map(lambda s: int(s[0][0]) if s and isinstance(s[0], list) and s[0] else -1),
        "last_step": steps.map(lambda s: int(s[-1][0]) if s and isinstance(s[-1], list) and s[-1] else -1),
        "stacks": df["stack_json"].map(parse)})[FLIGHT_COLUMNS]


HEATMAP_METRICS = {"step_ms": "duration_ns", "busy_ms": "busy_ns", "comm_ms": "comm_ns"}
#: How a bin of ranks shows each metric: its slowest rank (longest step and busy time) and the rank
#: that waits least in collectives (the one the others wait for).
HEATMAP_WORST = {"step_ms": "max", "busy_ms": "max", "comm_ms": "min"}


def step_time_heatmaps(store: Store, job: str, last_n: int = 400, max_cols: int = 100,
                       max_rows: int = 0, ranks: int = 0) -> pd.DataFrame:
    """Rank x step heatmap frame of every metric of :data:`HEATMAP_METRICS` for large jobs, in one
    pass: median per rank and bin of steps; steps are binned so that at most ``max_cols`` columns
    come back, ``step`` being the first step of its bin. Columns: rank, step, step_ms, busy_ms, comm_ms.

    With ``max_rows`` > 0 and more ranks than that, ranks are binned too (at most ``max_rows`` rows):
    ``rank`` is the first rank of its bin, ``ranks`` its range ("0-99"), each metric the bin's worst
    rank's (:data:`HEATMAP_WORST`) and ``worst_<metric>`` that rank. ``ranks``: the job's number of
    ranks when the caller knows it (its world size), else the store is asked (its highest rank + 1).
    """
    check_positive("last_n", last_n)
    check_positive("max_cols", max_cols)
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0, got {max_rows!r}")
    width = max(1, -(-int(last_n) // int(max_cols)))
    db = store.database
    # quantileExact, as the ranks table's medians: a bin holds a few steps, and the exact median of a
    # few values costs ~25% less than quantile's sampler state per (rank, bin).
    medians = ", ".join(f"quantileExact(0.5)({col}) / 1e6 AS {m}" for m, col in HEATMAP_METRICS.items())
    per_rank = f"""
        SELECT rank, intDiv(step, {{w:UInt32}}) * {{w:UInt32}} AS step_bin, {medians}
        FROM {db}.steps
        WHERE job = {{job:String}}
          AND step > (SELECT max(step) FROM {db}.steps WHERE job = {{job:String}}) - {{n:Int64}}
        GROUP BY rank, step_bin"""
    params = {"job": job, "n": int(last_n), "w": width}
    binned = False
    if max_rows:
        if ranks <= 0:
            top = store.query_rows(f"SELECT max(rank) + 1 FROM {db}.steps WHERE job = {{job:String}}", {"job": job})
            ranks = int(top[0][0] or 0) if top else 0
        binned = ranks > max_rows
    if not binned:
        df = store.query_df(per_rank + " ORDER BY rank, step_bin", params)
        cols = ["rank", "step", *HEATMAP_METRICS]
        return df.rename(columns={"step_bin": "step"})[cols] if not df.empty else pd.DataFrame(columns=cols)
    params["rw"] = -(-ranks // int(max_rows))
    worst = ", ".join(f"{HEATMAP_WORST[m]}({m}) AS bin_{m}, arg{HEATMAP_WORST[m].title()}(rank, {m}) AS worst_{m}"
                      for m in HEATMAP_METRICS)
    df = store.query_df(f"""
        SELECT intDiv(rank, {{rw:UInt32}}) * {{rw:UInt32}} AS rank_bin, step_bin, {worst},
               min(rank) AS lo, max(rank) AS hi
        FROM ({per_rank})
        GROUP BY rank_bin, step_bin ORDER BY rank_bin, step_bin""", params)
    cols = ["rank", "step", "ranks", *HEATMAP_METRICS, *(f"worst_{m}" for m in HEATMAP_METRICS)]
    if df.empty:
        return pd.DataFrame(columns=cols)
    df = df.rename(columns={"rank_bin": "rank", "step_bin": "step", **{f"bin_{m}": m for m in HEATMAP_METRICS}})
    df["ranks"] = df["lo"].astype(str) + "-" + df["hi"].astype(str)
    return df[cols]


def step_time_heatmap(store: Store, job: str, metric: str = "step_ms", last_n: int = 400,
                      max_cols: int = 100, max_rows: int = 0) -> pd.DataFrame:
    """Rank x step heatmap frame for large jobs: median ``metric`` per rank and bin of steps.

    ``metric`` is one of :data:`HEATMAP_METRICS` (step_ms, busy_ms, comm_ms). Steps are binned so
    that at most ``max_cols`` columns come back; ``step`` is the first step of its bin. Long
    format: rank, step, <metric>; with ranks binned too (``max_rows``, :func:`step_time_heatmaps`)
    also ranks and worst_rank.
    """
    if metric not in HEATMAP_METRICS:
        raise ValueError(f"metric must be one of {sorted(HEATMAP_METRICS)}, got {metric!r}")
    df = step_time_heatmaps(store, job, last_n=last_n, max_cols=max_cols, max_rows=max_rows)
    if "ranks" in df.columns:
        return df[["rank", "step", metric, "ranks", f"worst_{metric}"]].rename(columns={f"worst_{metric}": "worst_rank"})
    return df[["rank", "step", metric]]


def lost_rank_seconds(store: Store, job: str | None = None, now_ns: int | None = None) -> pd.DataFrame:
    """Lost rank-seconds per alert of a job (or all jobs): :data:`LOST_COLUMNS`, costliest first."""
    al = alerts(store, job=job, now_ns=now_ns)
    js = jobs(store, now_ns=now_ns)
    return lost_time(al, dict(zip(js["job"], js["world_size"], strict=True)))
