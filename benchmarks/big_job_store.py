"""A store as a 60 s job of 10,000 ranks leaves it, for the Job page's benchmark and browser test.

``build(store)`` writes the rows the sink writes for such a job (storage/convert.py's row shapes),
as Arrow tables with dictionary-encoded strings so that a few million rows take seconds, a table a
few batches at a time as the sink's batches arrive (so the tables have parts to merge, as after a
real run):

- ``jobs``: one job, ``JOB``, world size ``RANKS`` (10,000), 8 ranks per host;
- ``ranks``: one row per rank (host, pid, local rank, last step, last seen);
- ``steps``: 60 steps per rank (the hung rank 59), synchronous: a step lasts the slowest rank's busy
  time plus the all-reduce, each rank's ``comm_ns`` the rest; ``SLOW_RANK`` is 1.5x busy from step
  ``SLOW_FROM_STEP``; ``HUNG_RANK`` stops after step 58, the others complete step 59 and wait;
- ``heartbeats``: one per rank per second (``since_step_s`` growing after the hang; from
  ``STALL_STACK_S`` into it, the beat's stacks: ``HANG_FUNCTION`` on the hung rank, all_reduce on
  the others);
- ``worker_stats``: every 10 steps per rank, and one row per rank after the hang (``waiting``);
- ``hw_samples``: ``HW_METRICS`` of each GPU at 1 Hz;
- ``profile_samples``: each rank, 6 intervals of 10 s, ``PATHS`` call paths ``DEPTH`` frames deep
  of role training (20 Hz) plus the samples that left the message (path "", role other); the slow
  rank also runs ``SLOW_FUNCTION`` (a call path of its own, ~30% of its time);
- ``alerts``: the open hang (culprit ``HUNG_RANK``, two stack groups) and the open slow-rank alert
  (``SLOW_RANK``, its ``details.profile`` naming ``SLOW_FUNCTION``), as tests/dashboard/sample_data.py's.

Run as ``python -m benchmarks.big_job_store chdb:///path`` it fills that directory in a process of
its own (chDB admits one process per data directory) and prints the rows written as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import pyarrow as pa

from rankscope.protocol.alerts import Alert, StackGroup
from rankscope.storage.store import Store

S = 1_000_000_000
MS = 1_000_000
JOB = "big-10k"
RANKS = 10_000
GPUS_PER_HOST = 8
STEPS = 60
SLOW_RANK = 7
HUNG_RANK = 9_001
SLOW_FROM_STEP = 12
BUSY_NS = 500 * MS
ALLREDUCE_NS = 50 * MS
DURATION_S = 60
STALL_STACK_S = 5            # a beat carries stacks this long into a stall
HW_METRICS = ("gpu_util", "mem_util", "power_w", "temp_c", "sm_clock_mhz")
PROFILE_HZ = 20.0
PROFILE_INTERVAL_S = 10
PROFILE_INTERVALS = 6
PATHS = 20
DEPTH = 20
SLOW_FUNCTION = "data.py:30 tokenize_captions"
HANG_FUNCTION = "hang_forever"
HANG_FRAMES = ["train.py:88 main", "train.py:61 train_step", f"train.py:42 {HANG_FUNCTION}"]
WAIT_FRAMES = ["train.py:88 main", "train.py:64 train_step", "torch/distributed/distributed_c10d.py:2806 all_reduce"]
HANG_ALERT_ID = "hang-big-10k-0001"
SLOW_ALERT_ID = "slow-big-10k-0001"


def _dict(values: np.ndarray, names: list[str]) -> pa.DictionaryArray:
    """A dictionary-encoded string column: ``values`` indexes ``names``."""
    return pa.DictionaryArray.from_arrays(pa.array(values.astype(np.int32)), pa.array(names, type=pa.string()))


def _const(n: int, value: str) -> pa.DictionaryArray:
    return _dict(np.zeros(n, np.int32), [value])


def host_names(ranks: int = RANKS) -> list[str]:
    return [f"node-{h:04d}" for h in range(-(-ranks // GPUS_PER_HOST))]


def call_paths() -> list[str]:
    """The training thread's ``PATHS`` call paths, ``DEPTH`` frames deep under one training loop."""
    names = [f"torch/nn/modules/m{i}.py:{10 + i} Module{i}.forward" for i in range(40)]
    head = ["train.py:1 <module>", "train.py:80 main", "train.py:40 train_step"]
    return [";".join(head + [names[(p * 7 + d * 3) % 40] for d in range(DEPTH - len(head))]) for p in range(PATHS)]


def timeline(t0: int) -> tuple[np.ndarray, np.ndarray]:
    """Each step's start and end (ns), the same on every rank (synchronous training)."""
    starts, ends = [], []
    t = t0
    for s in range(STEPS):
        slowest = BUSY_NS * 3 // 2 if s >= SLOW_FROM_STEP else BUSY_NS
        starts.append(t)
        t += slowest + ALLREDUCE_NS + 2 * MS
        ends.append(t - 2 * MS)
    return np.array(starts, np.int64), np.array(ends, np.int64)


def build(store: Store, now_ns: int | None = None, ranks: int = RANKS) -> dict[str, int]:
    """Fill ``store`` with the job (the rows relative to ``now_ns``, default now); return the rows
    written per table."""
    now = time.time_ns() if now_ns is None else int(now_ns)
    t0 = now - DURATION_S * S
    rng = np.random.default_rng(26)
    hosts = host_names(ranks)
    rank_ids = np.arange(ranks, dtype=np.int32)
    host_of = rank_ids // GPUS_PER_HOST
    pid_of = 10_000 + rank_ids
    starts, ends = timeline(t0)
    hang_end = int(ends[STEPS - 2])                           # the hung rank's last step ended here
    rows: dict[str, int] = {}

    def put(table: str, cols: dict[str, Any]) -> None:
        rows[table] = rows.get(table, 0) + store.insert_arrow(table, pa.table(cols))

    # steps: one batch per 10 steps, all ranks (as the sink's batches carry every rank's beats).
    for first in range(0, STEPS, 10):
        step = np.tile(np.arange(first, first + 10, dtype=np.int64), ranks)
        rank = np.repeat(rank_ids, 10)
        keep = ~((rank == HUNG_RANK) & (step == STEPS - 1))
        step, rank = step[keep], rank[keep]
        busy = rng.normal(BUSY_NS, 0.02 * BUSY_NS, step.size).astype(np.int64)
        busy = np.where((rank == SLOW_RANK) & (step >= SLOW_FROM_STEP), BUSY_NS * 3 // 2, busy)
        start, end = starts[step], ends[step]
        dur = end - start
        busy = np.minimum(busy, dur)
        put("steps", {"job": _const(step.size, JOB), "rank": rank, "step": step, "start_ns": start, "end_ns": end,
                      "duration_ns": dur, "comm_ns": dur - busy, "busy_ns": busy,
                      "host": _dict(host_of[rank], hosts), "pid": pid_of[rank].astype(np.int32), "seq": step + 1})

    # heartbeats: 1 Hz per rank, phases spread over the second; batches of 10 s.
    last_end = np.where(rank_ids == HUNG_RANK, hang_end, int(ends[-1]))
    stacks = ["", json.dumps([{"thread": "MainThread", "frames": HANG_FRAMES}], separators=(",", ":")),
              json.dumps([{"thread": "MainThread", "frames": WAIT_FRAMES}], separators=(",", ":"))]
    for s0 in range(0, DURATION_S, 10):
        sec = np.tile(np.arange(s0, s0 + 10, dtype=np.int64), ranks)
        rank = np.repeat(rank_ids, 10)
        ts = t0 + sec * S + rank.astype(np.int64) * (S // ranks)
        done = np.searchsorted(ends, ts, side="right") - 1          # last step ended by then
        done = np.where(rank == HUNG_RANK, np.minimum(done, STEPS - 2), done)
        ended = np.where(done >= 0, ends[np.maximum(done, 0)], t0)
        since = (ts - ended) / S
        stalled = ts - last_end[rank] > STALL_STACK_S * S
        which = np.where(stalled, np.where(rank == HUNG_RANK, 1, 2), 0)
        put("heartbeats", {"job": _const(ts.size, JOB), "rank": rank, "ts_ns": ts, "step": done,
                           "since_step_s": since, "dropped": np.zeros(ts.size, np.int64),
                           "host": _dict(host_of[rank], hosts), "pid": pid_of[rank].astype(np.int32),
                           "seq": sec + 1, "stacks": _dict(which, stacks)})

    # worker_stats: every 10 steps, then once after the hang (every rank waiting: stage one cannot
    # tell the culprit from the ranks it blocks).
    for s in [*range(9, STEPS, 10), -1]:            # -1: the row after the hang
        after_hang = s < 0
        last = STEPS - 1 if after_hang else s
        n = ranks
        step = np.where(rank_ids == HUNG_RANK, min(last, STEPS - 2), last).astype(np.int64)
        ts = np.full(n, now - 2 * S if after_hang else int(ends[s]) + S // 2, np.int64)
        slow = (rank_ids == SLOW_RANK) & (last >= SLOW_FROM_STEP + 10)
        med_step = int(ends[last] - starts[last])
        med_busy = np.where(slow, BUSY_NS * 3 // 2, BUSY_NS).astype(np.int64)
        put("worker_stats", {"job": _const(n, JOB), "rank": rank_ids, "ts_ns": ts, "step": step,
                             "window_steps": np.full(n, 10, np.int32), "median_step_ns": np.full(n, med_step, np.int64),
                             "p95_step_ns": np.full(n, med_step + 2 * MS, np.int64), "median_busy_ns": med_busy,
                             "median_comm_ns": med_step - med_busy, "busy_z": np.where(slow, 9.5, 0.1),
                             "state": _dict(np.full(n, int(after_hang)), ["running", "waiting"]),
                             "cpu_wait_share": np.full(n, 0.02)})

    # hw_samples: HW_METRICS of each GPU at 1 Hz; batches of 10 s.
    metrics = list(HW_METRICS)
    base = {"gpu_util": 95.0, "mem_util": 57.0, "power_w": 650.0, "temp_c": 68.0, "sm_clock_mhz": 1980.0}
    for s0 in range(0, DURATION_S, 10):
        sec = np.tile(np.arange(s0, s0 + 10, dtype=np.int64), ranks * len(metrics))
        rank = np.repeat(np.tile(rank_ids, len(metrics)), 10)
        metric = np.repeat(np.arange(len(metrics), dtype=np.int32), ranks * 10)
        value = np.array([base[m] for m in metrics])[metric] * rng.uniform(0.97, 1.0, sec.size)
        idle = (sec * S + t0 > hang_end) & (metric == 0)            # GPUs idle in the hang
        value = np.where(idle, 0.0, value)
        put("hw_samples", {"job": _const(sec.size, JOB), "rank": rank, "host": _dict(host_of[rank], hosts),
                           "device": rank % GPUS_PER_HOST, "ts_ns": t0 + sec * S + S // 3,
                           "metric": _dict(metric, metrics), "value": value})

    # profile_samples: per interval (one batch each), every rank's PATHS paths + its "other" row.
    paths = call_paths()
    slow_path = paths[0].rsplit(";", DEPTH - 4)[0] + ";" + SLOW_FUNCTION
    path_names = [*paths, slow_path, ""]
    ticks = int(PROFILE_HZ * PROFILE_INTERVAL_S)
    counts = np.array([max(1, ticks // (2 + i)) for i in range(PATHS)], np.int64)
    for k in range(PROFILE_INTERVALS):
        start = t0 + k * PROFILE_INTERVAL_S * S
        rank = np.repeat(rank_ids, PATHS + 1)
        path = np.tile(np.r_[np.arange(PATHS), PATHS + 1], ranks)       # the "" row last
        samples = np.tile(np.r_[counts, ticks], ranks)
        role = (path == PATHS + 1).astype(np.int32)                     # 0 training, 1 other
        extra = (rank == SLOW_RANK) & (path == 0)                       # the slow rank: one more row
        rank = np.r_[rank, [SLOW_RANK]]
        path = np.r_[path, [PATHS]]
        samples = np.r_[np.where(extra, samples // 2, samples), [int(0.3 * ticks)]]
        role = np.r_[role, [0]]
        n = rank.size
        put("profile_samples", {"job": _const(n, JOB), "rank": rank.astype(np.int32),
                                "host": _dict(host_of[rank], hosts), "pid": pid_of[rank].astype(np.int32),
                                "ts_ns": np.full(n, start, np.int64),
                                "interval_ns": np.full(n, PROFILE_INTERVAL_S * S, np.int64),
                                "role": _dict(role, ["training", "other"]), "path": _dict(path, path_names),
                                "samples": samples.astype(np.uint32), "hz": np.full(n, PROFILE_HZ, np.float32)})

    put("ranks", {"job": _const(ranks, JOB), "rank": rank_ids, "host": _dict(host_of, hosts),
                  "pid": pid_of.astype(np.int32), "local_rank": (rank_ids % GPUS_PER_HOST).astype(np.int32),
                  "world_size": np.full(ranks, ranks, np.int32),
                  "last_step": np.where(rank_ids == HUNG_RANK, STEPS - 2, STEPS - 1).astype(np.int64),
                  "last_seen_ns": np.full(ranks, now - S, np.int64), "exit_reason": _const(ranks, ""),
                  "exit_detail": _const(ranks, "")})
    put("jobs", {"job": _const(1, JOB), "world_size": np.array([ranks], np.int32),
                 "first_seen_ns": np.array([t0], np.int64), "last_seen_ns": np.array([now - S], np.int64)})
    rows["alerts"] = store.insert("alerts", [alert_row(a) for a in alerts(now, hang_end, int(starts[SLOW_FROM_STEP]),
                                                                            ranks)])
    return rows


def alerts(now: int, hang_end: int, slow_from: int, ranks: int = RANKS) -> list[Alert]:
    """The open hang (published open, then updated with its stack groups) and the open slow-rank alert."""
    others = [r for r in range(ranks) if r != HUNG_RANK]
    groups = [StackGroup(ranks=[HUNG_RANK], thread="MainThread", frames=HANG_FRAMES, waiting_in_collective=False,
                         count=1),
              StackGroup(ranks=others[:32], thread="MainThread", frames=WAIT_FRAMES, waiting_in_collective=True,
                         count=len(others))]
    hang: dict[str, Any] = dict(alert_id=HANG_ALERT_ID, job=JOB, kind="hang", severity="critical", ranks=[HUNG_RANK],
                                step=STEPS - 2, opened_ns=hang_end + 10 * S)
    slow: dict[str, Any] = dict(alert_id=SLOW_ALERT_ID, job=JOB, kind="slow_rank", severity="warning",
                                ranks=[SLOW_RANK], step=SLOW_FROM_STEP + 20, opened_ns=slow_from + 20 * S)
    stalled = (now - hang_end) / S
    return [
        Alert(**hang, status="open", updated_ns=hang_end + 10 * S, version=1,
              summary=f"job {JOB} stalled at step {STEPS - 2}: rank {HUNG_RANK} not in a collective"),
        Alert(**hang, status="update", updated_ns=now - S, version=2, stack_groups=groups,
              summary=f"job {JOB} stalled at step {STEPS - 2} for {stalled:.0f} s: rank {HUNG_RANK} not in a "
                      "collective", details={"stalled_s": round(stalled, 1)}),
        Alert(**slow, status="open", updated_ns=now - 5 * S, version=3, lost_rank_seconds=1234.5,
              summary=f"rank {SLOW_RANK} is slow: busy 750 ms vs median 500 ms (z=9.5); "
                      f"most of it in {SLOW_FUNCTION}",
              details={"busy_ms": 750.0, "median_busy_ms": 500.0, "horizon_s": 20.0,
                       "profile": [{"function": SLOW_FUNCTION, "path": f"train.py:40 train_step;{SLOW_FUNCTION}",
                                    "share": 0.3, "peers_median_share": 0.0, "added_share": 0.3}]}),
    ]


def alert_row(a: Alert) -> dict[str, Any]:
    return {"alert_id": a.alert_id, "job": a.job, "kind": a.kind, "status": a.status, "severity": a.severity,
            "ranks": a.ranks, "step": a.step, "opened_ns": a.opened_ns, "updated_ns": a.updated_ns,
            "resolved_ns": a.resolved_ns, "version": a.version, "summary": a.summary,
            "lost_rank_seconds": a.lost_rank_seconds, "body": a.to_json().decode()}


def main(argv: list[str] | None = None) -> int:
    from rankscope.storage.store import close_store, open_store

    args = sys.argv[1:] if argv is None else argv
    dsn = args[0]
    t = time.perf_counter()
    store = open_store(dsn)
    rows = build(store)
    close_store(dsn)
    print(json.dumps({"dsn": dsn, "rows": rows, "build_s": round(time.perf_counter() - t, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
