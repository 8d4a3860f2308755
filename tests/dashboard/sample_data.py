"""Realistic store contents for dashboard tests, written the way the sink writes them.

Two jobs:

- ``llm-pretrain`` (world size 4; ranks 0,1 on node-a, ranks 2,3 on node-b): rank 1 is a straggler
  (open ``slow_rank`` alert, worker_stats state ``slow``) and rank 3 hangs in ``hang_forever``
  (open ``hang`` alert, published twice: open then update, with two stack groups).
- ``bert-finetune`` (world size 2, node-c): healthy, with one resolved ``slow_rank`` alert.

Usable in-process (``populate(store)``) or as a script that fills a chDB directory in its own
process (chDB locks a directory per process): ``python sample_data.py chdb:///path``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from rankscope.alerts import Alert, StackGroup
from storage.store import Store

S = 1_000_000_000
MS = 1_000_000
HANG_JOB = "llm-pretrain"
OK_JOB = "bert-finetune"
HANG_FUNCTION = "hang_forever"
HANG_ALERT_ID = "hang-llm-pretrain-0001"
SLOW_ALERT_ID = "slow-llm-pretrain-0001"
OLD_ALERT_ID = "slow-bert-finetune-0001"
HANG_FRAMES = [
    "train.py:88 main",
    "train.py:61 train_step",
    f"train.py:42 {HANG_FUNCTION}",
]
WAIT_FRAMES = [
    "train.py:88 main",
    "train.py:64 train_step",
    "torch/distributed/distributed_c10d.py:2806 all_reduce",
]


@dataclass(frozen=True)
class RankSpec:
    job: str
    rank: int
    host: str
    pid: int
    local_rank: int
    world_size: int
    steps: int          # steps completed (0 .. steps-1)
    busy_ms: float
    stats_state: str


RANKS = [
    RankSpec(HANG_JOB, 0, "node-a", 4100, 0, 4, 59, 40.0, "ok"),
    RankSpec(HANG_JOB, 1, "node-a", 4101, 1, 4, 59, 92.0, "slow"),
    RankSpec(HANG_JOB, 2, "node-b", 5200, 0, 4, 59, 41.0, "ok"),
    RankSpec(HANG_JOB, 3, "node-b", 5201, 1, 4, 58, 39.0, "ok"),
    RankSpec(OK_JOB, 0, "node-c", 6300, 0, 2, 30, 55.0, "ok"),
    RankSpec(OK_JOB, 1, "node-c", 6301, 1, 2, 30, 56.0, "ok"),
]


def populate(store: Store, now_ns: int | None = None) -> int:
    """Insert the sample rows; return the ``now_ns`` they are relative to."""
    now = time.time_ns() if now_ns is None else now_ns
    step_wall_ms = {HANG_JOB: 100.0, OK_JOB: 60.0}
    jobs_rows, ranks_rows, steps_rows, hb_rows, stats_rows, hw_rows = [], [], [], [], [], []
    for job, ws in ((HANG_JOB, 4), (OK_JOB, 2)):
        jobs_rows.append({"job": job, "world_size": ws, "first_seen_ns": now - 600 * S,
                          "last_seen_ns": now - S // 2})
    for r in RANKS:
        wall = step_wall_ms[r.job]
        # The hung rank stopped 30 s ago; the others finished their last step shortly after.
        t0 = now - 40 * S - r.steps * int(wall * MS)
        seq = 0
        for step in range(r.steps):
            jitter = ((step * 7 + r.rank * 3) % 5) - 2  # deterministic +-2 ms
            dur = int((wall + jitter) * MS)
            busy = int((r.busy_ms + jitter / 2) * MS)
            start = t0 + step * int(wall * MS)
            seq += 1
            steps_rows.append({"job": r.job, "rank": r.rank, "step": step, "start_ns": start,
                               "end_ns": start + dur, "duration_ns": dur, "comm_ns": max(0, dur - busy),
                               "busy_ns": min(busy, dur), "host": r.host, "pid": r.pid, "seq": seq})
        last_end = t0 + r.steps * int(wall * MS)
        for k in range(5):
            ts = now - (5 - k) * S + S // 2
            hb_rows.append({"job": r.job, "rank": r.rank, "ts_ns": ts, "step": r.steps - 1,
                            "since_step_s": round((ts - last_end) / S, 3), "dropped": 0, "host": r.host,
                            "pid": r.pid, "seq": 10_000 + k, "stacks": ""})
        ranks_rows.append({"job": r.job, "rank": r.rank, "host": r.host, "pid": r.pid,
                           "local_rank": r.local_rank, "world_size": r.world_size,
                           "last_step": r.steps - 1, "last_seen_ns": now - S // 2,
                           "exit_reason": "", "exit_detail": ""})
        stats_rows.append({"job": r.job, "rank": r.rank, "ts_ns": now - 2 * S, "step": r.steps - 1,
                           "window_steps": 20, "median_step_ns": int(wall * MS),
                           "p95_step_ns": int((wall + 2) * MS), "median_busy_ns": int(r.busy_ms * MS),
                           "median_comm_ns": int((wall - r.busy_ms) * MS),
                           "busy_z": 6.2 if r.stats_state == "slow" else 0.1, "state": r.stats_state})
        for k in range(12):
            ts = now - (12 - k) * 5 * S
            util = 35.0 if r.stats_state == "slow" else 97.0 - k % 3
            hw_rows.append({"job": r.job, "rank": r.rank, "host": r.host, "device": r.local_rank,
                            "ts_ns": ts, "metric": "gpu_util", "value": util})
    store.insert("jobs", jobs_rows)
    store.insert("ranks", ranks_rows)
    store.insert("steps", steps_rows)
    store.insert("heartbeats", hb_rows)
    store.insert("worker_stats", stats_rows)
    store.insert("hw_samples", hw_rows)
    store.insert("alerts", [_alert_row(a) for a in sample_alerts(now)])
    return now


def sample_alerts(now: int) -> list[Alert]:
    groups = [
        StackGroup(ranks=[3], thread="MainThread", frames=HANG_FRAMES, waiting_in_collective=False),
        StackGroup(ranks=[0, 1, 2], thread="MainThread", frames=WAIT_FRAMES, waiting_in_collective=True),
    ]
    hang: dict[str, Any] = dict(alert_id=HANG_ALERT_ID, job=HANG_JOB, kind="hang", severity="critical", ranks=[3], step=57,
                opened_ns=now - 25 * S)
    slow: dict[str, Any] = dict(alert_id=SLOW_ALERT_ID, job=HANG_JOB, kind="slow_rank", severity="warning", ranks=[1],
                step=50, opened_ns=now - 90 * S)
    old: dict[str, Any] = dict(alert_id=OLD_ALERT_ID, job=OK_JOB, kind="slow_rank", severity="warning", ranks=[0],
               step=12, opened_ns=now - 500 * S)
    return [
        Alert(**hang, status="open", updated_ns=now - 25 * S, version=1,
              summary="job llm-pretrain stalled at step 57: rank 3 not in a collective"),
        Alert(**hang, status="update", updated_ns=now - 5 * S, version=2, stack_groups=groups,
              summary="job llm-pretrain stalled at step 57 for 20 s: rank 3 not in a collective",
              details={"stalled_s": 20.0}),
        Alert(**slow, status="open", updated_ns=now - 10 * S, version=3, lost_rank_seconds=12.5,
              summary="rank 1 is slow: busy 92 ms vs median 40 ms (z=6.2)",
              details={"busy_ms": 92.0, "median_busy_ms": 40.0}),
        Alert(**old, status="open", updated_ns=now - 500 * S, version=1,
              summary="rank 0 is slow: busy 80 ms vs median 55 ms"),
        Alert(**old, status="resolved", updated_ns=now - 400 * S, version=2, resolved_ns=now - 400 * S,
              lost_rank_seconds=3.2, summary="rank 0 recovered"),
    ]


def _alert_row(a: Alert) -> dict[str, Any]:
    return {"alert_id": a.alert_id, "job": a.job, "kind": a.kind, "status": a.status,
            "severity": a.severity, "ranks": a.ranks, "step": a.step, "opened_ns": a.opened_ns,
            "updated_ns": a.updated_ns, "resolved_ns": a.resolved_ns, "version": a.version,
            "summary": a.summary, "lost_rank_seconds": a.lost_rank_seconds, "body": a.to_json().decode()}


if __name__ == "__main__":
    from storage.store import close_store, open_store

    dsn = sys.argv[1]
    st = open_store(dsn)
    populate(st)
    close_store(dsn)
    print("populated", dsn)
