"""Realistic store contents for dashboard tests, written the way the sink writes them.

Two jobs:

- ``llm-pretrain`` (world size 4; ranks 0,1 on node-a, ranks 2,3 on node-b): rank 1 is a straggler
  (open ``slow_rank`` alert, worker_stats state ``slow``) and rank 3 hangs in ``hang_forever``
  (open ``hang`` alert, published twice: open then update, with two stack groups).
- ``bert-finetune`` (world size 2, node-c): healthy, with one resolved ``slow_rank`` alert.

Hardware: ``gpu_util`` for every rank's GPU; node-a and node-b (2 GPUs each) also send every other
GPU metric and the host metrics (device -1). Trace windows of ``llm-pretrain``: ``WINDOW_ID``
(ranks 0-3, steps 50-52, rank 2 truncated; Python events as call paths "a;b;c" on ranks 0-2 and as
plain nested names on rank 3, plus CPU ops and kernels), with function summaries and a report;
and an older, stopped ``OLD_WINDOW_ID`` on rank 1.

Usable in-process (``populate(store)``) or as a script that fills a chDB directory in its own
process (chDB locks a directory per process): ``python sample_data.py chdb:///path``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from rankscope.protocol.alerts import Alert, StackGroup
from rankscope.storage.store import Store

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
WINDOW_ID = "tw0001abcd-0"
OLD_WINDOW_ID = "tw0000beef-0"
PY_FUNCTION = "forward"
GPU_METRICS = {"mem_util": 40.0, "mem_used_bytes": 30e9, "mem_total_bytes": 80e9, "power_w": 350.0, "temp_c": 65.0,
               "sm_clock_mhz": 1980.0, "pcie_tx_kbps": 2e5, "pcie_rx_kbps": 3e5, "nvlink_tx_kbps": 4e7,
               "nvlink_rx_kbps": 4.1e7}
HOST_METRICS = {"cpu_util": 55.0, "mem_used_bytes": 200e9, "mem_total_bytes": 1000e9, "net_tx_bytes_s": 1e8,
                "net_rx_bytes_s": 1.2e8, "disk_read_bytes_s": 5e7, "disk_write_bytes_s": 2e7}


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
                           "busy_z": 6.2 if r.stats_state == "slow" else 0.1, "state": r.stats_state,
                           "cpu_wait_share": 0.45 if r.stats_state == "slow" else 0.03})
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
    hw_rows += _more_hw(now)
    store.insert("hw_samples", hw_rows)
    store.insert("alerts", [_alert_row(a) for a in sample_alerts(now)])
    windows, events, summaries = _trace_windows(now)
    store.insert("trace_windows", windows)
    store.insert("trace_events", events)
    store.insert("function_summaries", summaries)
    store.insert("reports", [{"job": HANG_JOB, "window_id": WINDOW_ID, "created_ns": now - 60 * S,
                              "body": json.dumps(sample_report())}])
    stack = [{"thread": "MainThread", "frames": ["train.py:88 main", f"train.py:56 {HANG_FUNCTION}"]}]
    store.insert("flight_records", [
        {"job": HANG_JOB, "rank": 3, "ts_ns": now - 20 * S - k, "request_id": "flight-x", "reason": "alert",
         "host": "node-b", "pid": 4003, "steps": json.dumps([[s, 0, 0, 0] for s in range(40 - k, 58)]),
         "stacks": json.dumps(stack)} for k in (0, 5)])   # two dumps: the latest (k=0) is shown
    # The hang's Flight Recorder dumps: rank 3 never enqueued collective 58 of the default group.
    store.insert("fr_dumps", [
        {"job": HANG_JOB, "rank": r, "ts_ns": now - 20 * S, "request_id": f"flight-{HANG_ALERT_ID}", "reason": "alert",
         "host": "node-a", "pid": 4000 + r, "truncated": 0,
         "dump": json.dumps({"version": "2.10", "entries": [], "pg_config": {},
                             "pg_status": {"0": {"last_enqueued_collective": FR_LAST[r], "last_started_collective": -1,
                                                 "last_completed_collective": 57}}})} for r in range(4)])
    store.insert("profile_samples", _profiles(now))
    return now


# Sampled stacks of llm-pretrain: every rank trains in forward/backward; the straggler, rank 1, also
# spends seconds in PROFILE_EXTRA, which no other rank calls.
PROFILE_EXTRA = "augment_images"
PROFILE_MAIN = ["train.py:80 main", "train.py:50 train_step"]


def _profiles(now: int) -> list[dict[str, Any]]:
    rows = []
    for r in range(4):
        paths = {";".join([*PROFILE_MAIN, "model.py:10 forward"]): 120,
                 ";".join([*PROFILE_MAIN, "torch/autograd/__init__.py:200 backward"]): 60,
                 ";".join([*PROFILE_MAIN, "torch/distributed/distributed_c10d.py:2806 all_reduce"]): 20 if r == 1 else 80}
        if r == 1:
            paths[";".join([*PROFILE_MAIN, f"data.py:30 {PROFILE_EXTRA}"])] = 90
        for k in range(3):
            for path, n in paths.items():
                rows.append({"job": HANG_JOB, "rank": r, "host": "node-a" if r < 2 else "node-b", "pid": 4000 + r,
                             "ts_ns": now - (30 - 10 * k) * S, "interval_ns": 10 * S, "role": "training",
                             "path": path, "samples": n, "hz": 20.0})
    return rows


FR_LAST = {0: 58, 1: 58, 2: 58, 3: 57}   # each rank's last enqueued collective in the sample hang


def _more_hw(now: int) -> list[dict[str, Any]]:
    rows = []
    for r in RANKS:
        if r.host not in ("node-a", "node-b"):
            continue
        for k in range(12):
            ts = now - (12 - k) * 5 * S
            for m, v in GPU_METRICS.items():
                rows.append({"job": r.job, "rank": r.rank, "host": r.host, "device": r.local_rank, "ts_ns": ts,
                             "metric": m, "value": v * (1 + 0.02 * (k % 3)) + r.local_rank})
            if r.local_rank == 0:
                for m, v in HOST_METRICS.items():
                    rows.append({"job": r.job, "rank": r.rank, "host": r.host, "device": -1, "ts_ns": ts,
                                 "metric": m, "value": v * (1 + 0.05 * (k % 2))})
    return rows


def _trace_windows(now: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Trace windows, their events and function summaries (see the module docstring)."""
    start = now - 120 * S
    windows, events, summaries = [], [], []
    for rank in range(4):
        evs = []
        for step in (50, 51, 52):
            t = start + (step - 50) * 100 * MS
            calls = [("main", 0, 100), ("train_step", 2, 95), (PY_FUNCTION, 5, 35), ("backward", 42, 50),
                     ("loss", 10, 5)]
            stack = {"main": "main", "train_step": "main;train_step", PY_FUNCTION: f"main;train_step;{PY_FUNCTION}",
                     "backward": "main;train_step;backward", "loss": f"main;train_step;{PY_FUNCTION};loss"}
            for name, off, dur in calls:
                evs.append({"category": "python", "name": name if rank == 3 else stack[name],
                            "start_ns": t + off * MS, "dur_ns": dur * MS, "device": -1, "stream": -1, "step": step,
                            "bytes": 0, "attrs": {"tid": "1234"}})
            evs.append({"category": "cpu_op", "name": "aten::mm", "start_ns": t + 6 * MS, "dur_ns": 3 * MS,
                        "device": -1, "stream": -1, "step": step, "bytes": 0, "attrs": {"tid": "1234"}})
            evs.append({"category": "kernel", "name": "sm90_gemm", "start_ns": t + 7 * MS, "dur_ns": 20 * MS,
                        "device": rank % 2, "stream": 7, "step": step, "bytes": 0, "attrs": {}})
            evs.append({"category": "collective", "name": "ncclAllReduce", "start_ns": t + 60 * MS,
                        "dur_ns": 30 * MS, "device": rank % 2, "stream": 13, "step": step, "bytes": 1 << 26,
                        "attrs": {"collective": "all_reduce"}})
        events += [{"job": HANG_JOB, "window_id": WINDOW_ID, "rank": rank, **e} for e in evs]
        windows.append({"job": HANG_JOB, "window_id": WINDOW_ID, "rank": rank, "status": "complete",
                        "first_step": 50, "last_step": 52, "start_ns": start, "end_ns": start + 300 * MS,
                        "events": len(evs), "truncated": int(rank == 2), "updated_ns": start + S,
                        # rank 3 runs a tracer that does not send its thread's CPU times (-1)
                        "thread_cpu_ns": 200 * MS if rank < 3 else -1,
                        "thread_runq_ns": 50 * MS * (rank + 1) if rank < 3 else -1})
        for cat, name, n, total, excl in (("python", PY_FUNCTION, 3, 105, 90), ("python", "backward", 3, 150, 150),
                                          ("kernel", "sm90_gemm", 3, 60, 60)):
            summaries.append({"job": HANG_JOB, "window_id": WINDOW_ID, "rank": rank, "category": cat, "name": name,
                              "count": n, "total_ns": total * MS, "median_ns": total * MS // n,
                              "p95_ns": total * MS // n, "max_ns": total * MS // n, "exclusive_ns": excl * MS,
                              "window_ns": 300 * MS})
    windows.append({"job": HANG_JOB, "window_id": OLD_WINDOW_ID, "rank": 1, "status": "stopped", "first_step": 10,
                    "last_step": 11, "start_ns": now - 500 * S, "end_ns": now - 499 * S, "events": 0,
                    "truncated": 0, "updated_ns": now - 499 * S, "thread_cpu_ns": -1, "thread_runq_ns": -1})
    return windows, events, summaries


def sample_report() -> dict[str, Any]:
    """A report body shaped like the analyzer's: scalars, a dict, and lists of dicts."""
    return {
        "schema": "rankscope.analyze/1", "job": HANG_JOB, "window_id": WINDOW_ID, "ranks": [0, 1, 2, 3],
        "convention": {"name": "rankscope", "idle_threshold_us": 10},
        "temporal_breakdown": [{"rank": r, "idle_time_pctg": 5.0 + r, "compute_time_pctg": 70.0,
                                "non_compute_time_pctg": 25.0 - r} for r in range(4)],
        "top_kernels": [{"rank": 0, "name": "sm90_gemm", "sum (us)": 60000.0},
                        {"rank": 0, "name": "ncclAllReduce", "sum (us)": 90000.0}],
        "departures_from_hta": {"communication_kernels_not_nccl": 0, "last_step_kept": True},
    }


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
              details={"busy_ms": 92.0, "median_busy_ms": 40.0, "horizon_s": 20.0,
                       "profile": [{"function": f"data.py:30 {PROFILE_EXTRA}",
                                    "path": f"train.py:10 train;data.py:30 {PROFILE_EXTRA}",
                                    "share": 0.3, "peers_median_share": 0.0, "added_share": 0.3}]}),
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
    from rankscope.storage.store import close_store, open_store

    dsn = sys.argv[1]
    st = open_store(dsn)
    populate(st)
    close_store(dsn)
    print("populated", dsn)
