"""Report analysis on synthetic summaries of 4 workers (pure functions)."""

from __future__ import annotations

import pandas as pd
import pytest

from stream_processors.analysis.report import build_report, render_markdown, robust_z, straggler_from_arrivals

W = 100_000_000  # 100 ms window


def rows(slow_rank: int | None = None) -> pd.DataFrame:
    out = []
    for r in range(4):
        extra = 30_000_000 if r == slow_rank else 0
        out += [
            {"rank": r, "category": "python", "name": "main;train;compute", "count": 10, "total_ns": 40_000_000,
             "exclusive_ns": 2_000_000, "window_ns": W},
            {"rank": r, "category": "cpu_op", "name": "aten::mm", "count": 100, "total_ns": 38_000_000 + extra,
             "exclusive_ns": 38_000_000 + extra, "window_ns": W},
            {"rank": r, "category": "collective", "name": "gloo:all_reduce", "count": 10,
             "total_ns": 50_000_000 - (extra if r == slow_rank else -extra // 3 if slow_rank is not None else 0),
             "exclusive_ns": 40_000_000, "window_ns": W},
        ]
        if r == slow_rank:
            out.append({"rank": r, "category": "python", "name": "main;train;slow_extra_compute", "count": 10,
                        "total_ns": 31_000_000, "exclusive_ns": 500_000, "window_ns": W})
    return pd.DataFrame(out)


def test_slow_worker_and_named_function_are_top_cause():
    rep = build_report(rows(slow_rank=2), job="j", window_id="w")
    assert [s["rank"] for s in rep["slow_workers"]] == [2]
    assert rep["causes"][0]["leaf"] == "slow_extra_compute" and rep["causes"][0]["rank"] == 2
    assert rep["causes"][0]["cost_rank_seconds"] == pytest.approx(0.031 * 4)
    assert any("gpu_compute" in x for x in rep["not_applicable"])
    assert "## Slow workers" in render_markdown(rep)


def test_healthy_window_has_no_abnormal_worker():
    rep = build_report(rows(), job="j", window_id="w")
    assert rep["slow_workers"] == [] and rep["abnormal_workers"] == [] and rep["causes"] == []


def test_missing_columns_and_empty_input_are_errors():
    with pytest.raises(ValueError, match="lack columns"):
        build_report(pd.DataFrame({"rank": [0]}))
    with pytest.raises(ValueError, match="no summaries"):
        build_report(rows().iloc[0:0])


def test_arrivals_name_the_last_rank():
    recs = []
    for seq in range(20):
        for r in range(4):
            recs.append({"rank": r, "name": "allreduce", "seq": seq, "start_ns": seq * 10**7 + (5 * 10**6 if r == 1 else r * 1000)})
    res = straggler_from_arrivals(pd.DataFrame(recs), world=4)
    assert res["straggler"] == 1 and res["straggler_share"] == 1.0 and res["matched_calls"] == 20
    assert res["what_if_saving_rank_seconds"] > 0


def test_robust_z_flags_one_outlier():
    z = robust_z(pd.Series([1.0e6, 1.1e6, 0.9e6, 4.0e6]))
    assert z.iloc[3] > 4 and abs(z.iloc[0]) < 2
