"""Slow workers of a window when ranks share cores: run-queue wait taken into account (pure functions)."""

from __future__ import annotations

import pandas as pd
import pytest

from rankscope.stream_processors.analysis.report import build_report
from rankscope.stream_processors.analysis.summaries import summary_frames

W = 500_000_000   # a 500 ms window
MS = 1_000_000


def window(busy_ms: dict[int, float], runq_ms: dict[int, float] | None, cpu_ms: dict[int, float] | None = None
           ) -> pd.DataFrame:
    """4 ranks: one op with the given busy time, a collective, and the training thread's counters."""
    out = []
    for r, b in busy_ms.items():
        base = {"rank": r, "window_ns": W}
        if runq_ms is not None:
            base |= {"thread_runq_ns": int(runq_ms[r] * MS), "thread_cpu_ns": int((cpu_ms or {}).get(r, 150) * MS)}
        out += [{**base, "category": "cpu_op", "name": "aten::mm", "count": 100, "total_ns": int(b * MS),
                 "exclusive_ns": int(b * MS)},
                {**base, "category": "collective", "name": "gloo:all_reduce", "count": 10, "total_ns": 100 * MS,
                 "exclusive_ns": 100 * MS}]
    return pd.DataFrame(out)


def test_a_rank_slower_only_by_its_wait_for_a_cpu_is_not_slow() -> None:
    # Measured on 2 shared cores: rank 2 35% above its peers over a 10-step window of a healthy job.
    df = window({0: 66.8, 1: 67.4, 2: 90.9, 3: 70.3}, runq_ms={0: 80, 1: 85, 2: 130, 3: 90})
    assert [s["rank"] for s in build_report(df.drop(columns=["thread_runq_ns", "thread_cpu_ns"]))["slow_workers"]] == [2]
    rep = build_report(df)
    assert rep["slow_workers"] == [] and rep["abnormal_workers"] == [] and rep["causes"] == []
    only = rep["slow_only_by_cpu_wait"]
    assert [o["rank"] for o in only] == [2] and only[0]["extra_cpu_wait_ms"] == pytest.approx(28.7, abs=0.05)
    assert rep["host_cpu_wait_ms"]["2"] == 130.0 and rep["host_cpu_wait_share"]["2"] == round(130 / 280, 3)


def test_a_rank_whose_excess_its_wait_does_not_cover_is_slow_by_its_work() -> None:
    # The 4x straggler of the same runs: ready to run longer, it waited 115 ms longer, at its peers' share.
    df = window({0: 70.4, 1: 262.6, 2: 69.8, 3: 68.2}, runq_ms={0: 131, 1: 232, 2: 33, 3: 117},
                cpu_ms={0: 86, 1: 309, 2: 89, 3: 85})
    rep = build_report(df)
    (s,) = rep["slow_workers"]
    assert s["rank"] == 1 and s["held_back_by_host"] is False and s["extra_cpu_wait_ms"] == 0.0
    assert rep["abnormal_workers"] == [1] and rep["slow_only_by_cpu_wait"] == []


def test_a_rank_its_host_starves_is_slow_and_held_back_by_its_host() -> None:
    # Rank 3 waited for a CPU 80% of the time it was ready to run; its peers 20%.
    df = window({0: 60, 1: 61, 2: 59, 3: 120}, runq_ms={0: 15, 1: 15, 2: 15, 3: 240},
                cpu_ms={0: 60, 1: 60, 2: 60, 3: 60})
    rep = build_report(df)
    (s,) = rep["slow_workers"]
    assert s["rank"] == 3 and s["held_back_by_host"] is True
    assert s["cpu_wait_share"] == 0.8 and s["peers_cpu_wait_share"] == 0.2
    assert rep["abnormal_workers"] == [3]


def test_without_every_ranks_wait_the_wall_busy_time_decides() -> None:
    df = window({0: 66.8, 1: 67.4, 2: 90.9, 3: 70.3}, runq_ms={0: 80, 1: 85, 2: 130, 3: 90})
    df.loc[df["rank"] == 0, "thread_runq_ns"] = None     # an older rank: no thread_cpu in its summary
    rep = build_report(df)
    assert [s["rank"] for s in rep["slow_workers"]] == [2] and "held_back_by_host" not in rep["slow_workers"][0]
    assert "host_cpu_wait_ms" not in rep


def test_summary_frames_carry_the_threads_counters_and_refuse_bad_ones() -> None:
    body = {"window_id": "w", "start_ns": 0, "end_ns": W,
            "functions": {"category": ["cpu_op"], "name": ["aten::mm"], "count": [1], "total_ns": [5],
                          "median_ns": [5], "p95_ns": [5], "max_ns": [5], "exclusive_ns": [5], "window_ns": W}}
    fn, _ = summary_frames(3, {**body, "thread_cpu": [7, 9]})
    assert fn["thread_cpu_ns"].tolist() == [7] and fn["thread_runq_ns"].tolist() == [9]
    assert "thread_runq_ns" not in summary_frames(3, body)[0]
    for bad in ([1], [1, -2], [1, 2.5], "x"):
        with pytest.raises(ValueError, match="summary.thread_cpu"):
            summary_frames(3, {**body, "thread_cpu": bad})


def test_the_verdict_and_the_alert_say_which_ranks_were_held_back_by_their_host() -> None:
    from rankscope.report_view import verdict
    from rankscope.stream_processors.report_alerts import _summary

    starved = build_report(window({0: 60, 1: 61, 2: 59, 3: 120}, runq_ms={0: 15, 1: 15, 2: 15, 3: 240},
                                  cpu_ms={0: 60, 1: 60, 2: 60, 3: 60}))
    assert any("Rank 3 is held back by its host" in line and "80%" in line for line in verdict(starved).lines)
    assert "held back by its host (waited for a CPU 80% of its ready time, peers 20%)" in _summary(starved)
    shared = build_report(window({0: 66.8, 1: 67.4, 2: 90.9, 3: 70.3}, runq_ms={0: 80, 1: 85, 2: 130, 3: 90}))
    v = verdict(shared)
    assert v.slow_ranks == [] and any("waited 28.7 ms longer for a CPU" in line for line in v.lines)
