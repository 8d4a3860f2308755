"""Report analysis on synthetic summaries of 4 workers (pure functions)."""

from __future__ import annotations

import pandas as pd
import pytest

from rankscope.own_frames import is_own_frame
from rankscope.report_view import render_markdown
from rankscope.stream_processors.analysis.outliers import peer_z
from rankscope.stream_processors.analysis.report import build_report, straggler_from_arrivals

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
    md = render_markdown(rep)
    assert "## Slow workers" in md and "Rank 2 is slow" in md and "rank-seconds" in md


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
    late = res["mean_lateness_ms_by_rank"]
    assert late["1"] > 4 and all(abs(late[str(r)]) < 0.01 for r in (0, 2, 3))


def test_peer_z_flags_one_outlier():
    z = peer_z({0: 1.0e6, 1: 1.1e6, 2: 0.9e6, 3: 4.0e6})
    assert z[3].z > 4 and abs(z[0].z) < 2 and z[3].baseline == 1.0e6


def test_threads_and_own_frames_are_not_causes_and_deepest_path_wins():
    df = rows(slow_rank=2)
    extra = []
    for r in range(4):
        win = W + (40_000_000 if r == 2 else 0)          # the slow rank's window ran longer
        extra += [
            # a background thread whose only work is rankscope's heartbeat
            {"rank": r, "category": "python", "name": "threading.py(1002): _bootstrap", "count": 1,
             "total_ns": win, "exclusive_ns": 0, "window_ns": W},
            {"rank": r, "category": "python", "name": "threading.py(1002): _bootstrap;threading.py(982): run",
             "count": 1, "total_ns": win, "exclusive_ns": 0, "window_ns": W},
            {"rank": r, "category": "python",
             "name": "threading.py(1002): _bootstrap;threading.py(982): run;producers/tracer.py(1): _beat",
             "count": 1, "total_ns": win, "exclusive_ns": 0, "window_ns": W},
            # the user's loop calls the tracer: its time is not the user's
            {"rank": r, "category": "python", "name": "main", "count": 1,
             "total_ns": 60_000_000 + (31_000_000 if r == 2 else 0) + (25_000_000 if r == 2 else 0),
             "exclusive_ns": 0, "window_ns": W},
            {"rank": r, "category": "python", "name": "main;producers/tracer.py(9): step", "count": 10,
             "total_ns": 25_000_000 if r == 2 else 0, "exclusive_ns": 0, "window_ns": W},
            {"rank": r, "category": "python", "name": "main;train", "count": 1,
             "total_ns": 55_000_000 + (31_000_000 if r == 2 else 0), "exclusive_ns": 0, "window_ns": W},
        ]
        if r == 2:   # the slow function's internals carry the same excess: the function is named, not them
            extra += [{"rank": r, "category": "python", "name": "main;train;slow_extra_compute;compute",
                       "count": 10, "total_ns": 30_500_000, "exclusive_ns": 0, "window_ns": W},
                      {"rank": r, "category": "python", "name": "main;train;slow_extra_compute;compute;aten::matmul",
                       "count": 10, "total_ns": 30_000_000, "exclusive_ns": 0, "window_ns": W}]
    rep = build_report(pd.concat([df, pd.DataFrame(extra)], ignore_index=True), job="j", window_id="w")
    assert rep["causes"][0]["leaf"] == "slow_extra_compute", rep["causes"][:3]
    names = [c["function"] for c in rep["causes"]]
    assert not any("_bootstrap" in n or "producers/" in n for n in names)
    assert "main" not in names and "main;train" not in names   # shadowed by the deeper path with the excess
    assert not any("slow_extra_compute;" in n for n in names)   # internals of the cause


def test_open_frames_of_windows_of_different_length_are_not_causes():
    wins = {0: 4.4 * W, 1: 4.5 * W, 2: 5.0 * W, 3: 0.8 * W}   # profiler start-up and waiting differ by rank
    df = rows(slow_rank=2)
    df["window_ns"] = df["rank"].map(wins)
    extra = [{"rank": r, "category": "python", "name": p, "count": 1, "total_ns": wins[r] * f,
              "exclusive_ns": 0, "window_ns": wins[r]}
             for r in range(4) for p, f in (("<frozen runpy>(198): _run_module_as_main", 1.0),
                                            ("<frozen runpy>(198): _run_module_as_main;train.py(9): main", 0.99))]
    rep = build_report(pd.concat([df, pd.DataFrame(extra)], ignore_index=True), job="j", window_id="w")
    assert rep["causes"][0]["leaf"] == "slow_extra_compute", rep["causes"][:3]
    assert not any("runpy" in c["function"] for c in rep["causes"])


def test_one_stretched_call_does_not_make_a_worker_slow():
    df = rows()
    df["median_ns"] = df["total_ns"] // df["count"]
    hiccup = (df["rank"] == 3) & (df["name"] == "aten::mm")
    df.loc[hiccup, ["total_ns", "exclusive_ns"]] += 40_000_000   # one call preempted for 40 ms
    assert build_report(df, job="j", window_id="w")["slow_workers"] == []
    slow = rows(slow_rank=3)                                          # every call slower: slow
    slow["median_ns"] = slow["total_ns"] // slow["count"]
    assert [s["rank"] for s in build_report(slow, job="j", window_id="w")["slow_workers"]] == [3]


def test_python_function_comes_before_the_ops_it_runs():
    df = rows(slow_rank=2)
    df.loc[(df["rank"] == 2) & (df["name"] == "aten::mm"), "total_ns"] += 5_000_000   # op excess 35 ms > path 31 ms
    rep = build_report(df, job="j", window_id="w")
    assert rep["causes"][0]["leaf"] == "slow_extra_compute" and rep["causes"][1]["function"] == "aten::mm"


def test_causes_hold_no_own_frames_and_keep_users_modules_named_like_rankscopes():
    df = rows(slow_rank=2)
    extra = []
    for r in range(4):
        slow = r == 2
        extra += [
            # rankscope's wrapper, bare and in an installed path, carries the slow rank's biggest excess
            {"rank": r, "category": "python", "name": "main;train;_rankscope_timed_wait", "count": 10,
             "total_ns": 5_000_000 + (45_000_000 if slow else 0), "exclusive_ns": 0, "window_ns": W},
            {"rank": r, "category": "python",
             "name": "main;train;site-packages/rankscope/producers/step_hooks.py(20): after_step", "count": 10,
             "total_ns": 1_000_000 + (40_000_000 if slow else 0), "exclusive_ns": 0, "window_ns": W},
            # the user's own package called producers: the user's code
            {"rank": r, "category": "python", "name": "main;train;myjob/producers/loader.py(3): load_batch",
             "count": 10, "total_ns": 2_000_000 + (35_000_000 if slow else 0), "exclusive_ns": 0, "window_ns": W},
        ]
    rep = build_report(pd.concat([df, pd.DataFrame(extra)], ignore_index=True), job="j", window_id="w")
    names = [c["function"] for c in rep["causes"]]
    assert names and not [n for n in names if any(is_own_frame(f) for f in n.split(";"))], names
    assert "main;train;myjob/producers/loader.py(3): load_batch" in names, names
