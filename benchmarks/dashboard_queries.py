"""Dashboard query latency on a large embedded store: every data query of the job page and fleet overview.

Builds a chDB store in a temp dir, the way the sink writes (column batches through
``Store.insert_columns``, in arrival order: all ranks, a range of steps at a time):

- job ``bench-1k``: 1,000 ranks on 125 hosts x 8 GPUs, 10,000 steps each (10M step rows), a heartbeat
  per rank per second, worker stats every 10 steps, a hang and a slow-rank alert with stacks;
- job ``bench-8``: 8 ranks x 10,000 steps (the job page draws line charts, not a heatmap, below 64 ranks);
- ``hw_samples``: 5 GPU metrics per GPU per second over the same ~17 minutes.

Then times each query function of :mod:`rankscope.dashboard.queries` the pages call (median of ``REPEATS``
runs after one cold run, which is reported too). Target: under 1 s each (the host page's two
queries are timed for reference). ``steps_parts_at_query_time`` shows how merged the table was.
Run alone with ``python -m benchmarks.dashboard_queries``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from rankscope.dashboard import queries as q
from rankscope.storage.store import Store, close_store, open_store

RANKS = 1_000
GPUS_PER_HOST = 8
STEPS = 10_000
SMALL_RANKS = 8
STEP_NS = 100_000_000
CHUNK_STEPS = 1_000          # steps per insert batch (1M rows for the big job)
HW_METRICS = ("gpu_util", "mem_util", "power_w", "temp_c", "sm_clock_mhz")
REPEATS = 5
TARGET_S = 1.0
BIG, SMALL = "bench-1k", "bench-8"


def _steps_chunk(job: str, ranks: int, first: int, last: int, t0: int, rng: np.random.Generator) -> dict[str, Any]:
    n_steps = last - first
    rank = np.repeat(np.arange(ranks, dtype=np.int32), n_steps)
    step = np.tile(np.arange(first, last, dtype=np.int64), ranks)
    busy = rng.normal(80e6, 2e6, rank.size).astype(np.int64)
    busy[rank == 7] += 60_000_000                                  # one straggler
    dur = np.full(rank.size, 150_000_000, dtype=np.int64)          # everyone waits for the straggler
    start = t0 + step * STEP_NS
    return {"job": [job] * rank.size, "rank": rank, "step": step, "start_ns": start, "end_ns": start + dur,
            "duration_ns": dur, "comm_ns": np.maximum(dur - busy, 0), "busy_ns": np.minimum(busy, dur),
            "host": [f"node-{r // GPUS_PER_HOST:03d}" for r in rank.tolist()], "pid": 10_000 + rank,
            "seq": step + 1}


def build(store: Store, now: int) -> dict[str, int]:
    """Fill ``store``; return rows written per table."""
    rng = np.random.default_rng(7)
    t0 = now - STEPS * STEP_NS - 1_000_000_000
    rows: dict[str, int] = {}

    def put(table: str, cols: dict[str, Any]) -> None:
        rows[table] = rows.get(table, 0) + store.insert_columns(table, cols)

    for first in range(0, STEPS, CHUNK_STEPS):
        put("steps", _steps_chunk(BIG, RANKS, first, first + CHUNK_STEPS, t0, rng))
        put("steps", _steps_chunk(SMALL, SMALL_RANKS, first, first + CHUNK_STEPS, t0, rng))
    put("jobs", {"job": [BIG, SMALL], "world_size": [RANKS, SMALL_RANKS], "first_seen_ns": [t0, t0],
                 "last_seen_ns": [now, now]})
    for job, n in ((BIG, RANKS), (SMALL, SMALL_RANKS)):
        r = list(range(n))
        put("ranks", {"job": [job] * n, "rank": r, "host": [f"node-{i // GPUS_PER_HOST:03d}" for i in r],
                      "pid": [10_000 + i for i in r], "local_rank": [i % GPUS_PER_HOST for i in r],
                      "world_size": [n] * n, "last_step": [STEPS - 1] * n, "last_seen_ns": [now] * n,
                      "exit_reason": [""] * n, "exit_detail": [""] * n})
    seconds = STEPS * STEP_NS // 1_000_000_000
    for s0 in range(0, seconds, 250):                             # heartbeats: 1 Hz per rank
        secs = np.arange(s0, min(seconds, s0 + 250), dtype=np.int64)
        rank = np.repeat(np.arange(RANKS, dtype=np.int32), secs.size)
        ts = t0 + np.tile(secs, RANKS) * 1_000_000_000
        put("heartbeats", {"job": [BIG] * rank.size, "rank": rank, "ts_ns": ts, "step": (ts - t0) // STEP_NS,
                           "since_step_s": np.full(rank.size, 0.05), "dropped": np.zeros(rank.size, np.int64),
                           "host": [f"node-{x // GPUS_PER_HOST:03d}" for x in rank.tolist()],
                           "pid": 10_000 + rank, "seq": ts // 1_000_000_000, "stacks": [""] * rank.size})
    st_steps = np.arange(9, STEPS, 10, dtype=np.int64)               # worker stats every 10 steps
    rank = np.repeat(np.arange(RANKS, dtype=np.int32), st_steps.size)
    step = np.tile(st_steps, RANKS)
    put("worker_stats", {"job": [BIG] * rank.size, "rank": rank, "ts_ns": t0 + (step + 1) * STEP_NS, "step": step,
                         "window_steps": np.full(rank.size, 20, np.int32),
                         "median_step_ns": np.full(rank.size, 150_000_000), "p95_step_ns": np.full(rank.size, 152_000_000),
                         "median_busy_ns": np.where(rank == 7, 140_000_000, 80_000_000),
                         "median_comm_ns": np.where(rank == 7, 10_000_000, 70_000_000), "busy_z": np.where(rank == 7, 8.0, 0.1),
                         "state": np.where(rank == 7, "slow", "ok").tolist()})
    gpus = RANKS
    for s0 in range(0, seconds, 200):                              # hw: 5 GPU metrics at 1 Hz
        secs = np.arange(s0, min(seconds, s0 + 200), dtype=np.int64)
        dev = np.repeat(np.arange(gpus, dtype=np.int32), secs.size)
        ts = t0 + np.tile(secs, gpus) * 1_000_000_000
        hosts = [f"node-{d // GPUS_PER_HOST:03d}" for d in dev.tolist()]
        for m in HW_METRICS:
            put("hw_samples", {"job": [BIG] * dev.size, "rank": dev, "host": hosts, "device": dev % GPUS_PER_HOST,
                               "ts_ns": ts, "metric": [m] * dev.size, "value": rng.uniform(50, 100, dev.size)})
    groups = [{"ranks": [3], "thread": "MainThread", "frames": ["train.py:88 main", "train.py:42 hang_forever"],
               "waiting_in_collective": False},
              {"ranks": [r for r in range(RANKS) if r != 3], "thread": "MainThread",
               "frames": ["train.py:88 main", "c10d.py:2806 all_reduce"], "waiting_in_collective": True}]
    body = json.dumps({"stack_groups": groups})
    put("alerts", {"alert_id": ["hang-1", "slow-1"], "job": [BIG, BIG], "kind": ["hang", "slow_rank"],
                   "status": ["open", "open"], "severity": ["critical", "warning"], "ranks": [[3], [7]],
                   "step": [STEPS - 1, STEPS - 100], "opened_ns": [now - 20 * 10**9, now - 300 * 10**9],
                   "updated_ns": [now - 5 * 10**9, now - 10 * 10**9], "resolved_ns": [0, 0], "version": [2, 3],
                   "summary": ["hang", "slow"], "lost_rank_seconds": [0.0, 30.0], "body": [body, "{}"]})
    return rows


def page_queries(now: int) -> dict[str, Callable[[Store], Any]]:
    """Every store query the fleet overview and the job page run, with the pages' arguments."""
    return {
        # Fleet overview
        "fleet.jobs": lambda s: q.jobs(s, now_ns=now),
        "fleet.hosts": lambda s: q.hosts(s, now_ns=now),
        "fleet.gpu_util_series_15m": lambda s: q.gpu_util_series(s, window_s=900, bucket_s=q.bucket_for(900, 120),
                                                                  now_ns=now),
        # Job page, 1,000 ranks (ranks table, heatmaps, alerts)
        "job.ranks": lambda s: q.ranks(s, BIG, now_ns=now),
        "job.alerts": lambda s: q.alerts(s, job=BIG, now_ns=now),
        "job.step_time_heatmap.busy_ms": lambda s: q.step_time_heatmap(s, BIG, metric="busy_ms"),
        "job.step_time_heatmap.step_ms": lambda s: q.step_time_heatmap(s, BIG, metric="step_ms"),
        "job.step_time_heatmap.comm_ms": lambda s: q.step_time_heatmap(s, BIG, metric="comm_ms"),
        # Job page, 8 ranks (line charts)
        "job8.ranks": lambda s: q.ranks(s, SMALL, now_ns=now),
        "job8.step_times": lambda s: q.step_times(s, SMALL),
        # Host page (not a target of this benchmark, timed for reference)
        "host.hw_series_15m": lambda s: q.hw_series(s, "node-000", now - 900 * 10**9, now),
        "host.hw_latest_15m": lambda s: q.hw_latest(s, "node-000", now - 900 * 10**9, now_ns=now),
    }


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(repeats: int = REPEATS) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="rankscope-bench-dash-")
    dsn = f"chdb://{tmp}/clickhouse"
    try:
        store = open_store(dsn)
        now = time.time_ns()
        t = time.perf_counter()
        rows = build(store, now)
        build_s = time.perf_counter() - t
        parts = store.query_rows(
            f"SELECT count() FROM system.parts WHERE database = '{store.database}' AND table = 'steps' AND active")
        metrics: dict[str, Any] = {"build_s": round(build_s, 1), "rows_total": sum(rows.values()),
                                   "step_rows": rows["steps"], "steps_parts_at_query_time": int(parts[0][0]),
                                   "insert_rows_per_s": round(sum(rows.values()) / build_s)}
        targets: dict[str, str] = {}
        for name, fn in page_queries(now).items():
            cold = _time(partial(fn, store))
            runs = [_time(partial(fn, store)) for _ in range(repeats)]
            metrics[f"{name}_s"] = round(statistics.median(runs), 3)
            metrics[f"{name}_cold_s"] = round(cold, 3)
            targets[f"{name}_s"] = f"< {TARGET_S:g}"
        return {"name": "dashboard_queries", "metrics": metrics, "targets": targets,
                "rows": rows, "repeats": repeats,
                "slow": [k for k, v in metrics.items() if k in targets and v >= TARGET_S]}
    finally:
        close_store(dsn)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
