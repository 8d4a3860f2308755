"""The diagnosis reading (verdict, chart data, sections, Markdown) of real analyzer output."""

from __future__ import annotations

import pandas as pd

from rankscope import report_view as rv
from rankscope.stream_processors.analysis.report import build_report


def report(slow: int | None = 2) -> dict:
    rows, arrivals = [], []
    for r in range(4):
        extra = 30_000_000 if r == slow else 0
        rows += [{"rank": r, "category": "cpu_op", "name": "aten::mm", "count": 100, "total_ns": 38_000_000 + extra,
                  "exclusive_ns": 38_000_000 + extra, "window_ns": 100_000_000},
                 {"rank": r, "category": "kernel", "name": "k" * 300, "count": 10, "total_ns": 5_000_000,
                  "exclusive_ns": 4_000_000, "window_ns": 100_000_000},
                 {"rank": r, "category": "collective", "name": "gloo:all_reduce", "count": 10,
                  "total_ns": 50_000_000 - extra, "exclusive_ns": 40_000_000, "window_ns": 100_000_000}]
        arrivals += [{"rank": r, "name": "c10d::allreduce_", "seq": k,
                      "start_ns": k * 10**7 + (3 * 10**6 if r == slow else r)} for k in range(10)]
    return build_report(pd.DataFrame(rows), pd.DataFrame(arrivals), job="j", window_id="w")


def test_verdict_names_the_slow_rank_its_cost_and_the_straggler() -> None:
    rep = report()
    v = rv.verdict(rep)
    assert v.slow_ranks == [2] and v.straggler == 2
    assert v.headline.startswith("Slow worker: rank 2; top cause `aten::mm` (0.120 rank-seconds)")
    assert v.lines[0].startswith("Rank 2 is slow: busy 72.0 ms in the window vs 42.0 ms on the other ranks (+71%")
    assert any(line.startswith("Straggler at collectives: rank 2 arrives last at 100% of 10") for line in v.lines)
    assert v.cost_rank_seconds == sum(c["cost_rank_seconds"] for c in rep["causes"])
    # An offline report carries its diagnosis under "diagnosis": the same reading.
    assert rv.verdict({"schema": "rankscope.analyze/1", "diagnosis": rep}) == v


def test_healthy_and_empty_reports() -> None:
    v = rv.verdict(report(slow=None))
    assert v.headline.startswith("No slow worker") and v.slow_ranks == []
    assert rv.verdict({"temporal_breakdown": []}).headline == "No diagnosis in this report"
    assert rv.chart_data({}) == {"busy": [], "lateness": [], "bottleneck": []}


def test_chart_data_and_sections() -> None:
    rep = report()
    c = rv.chart_data(rep)
    assert [b["rank"] for b in c["busy"] if b["slow"]] == [2]
    assert max(c["lateness"], key=lambda x: x["lateness (ms)"])["straggler"] is True
    assert {b["category"] for b in c["bottleneck"]} >= {"cpu_op", "kernel", "collective"}
    secs = {s.key: s for s in rv.sections(rep)}
    assert list(secs)[:2] == ["slow_workers", "causes"]
    assert {"gpu_compute", "communication", "collective_arrivals"} <= set(secs)
    assert all(s.explanation for s in secs.values())
    comm = secs["communication"].rows[0]
    assert "mean throughput (GB/s)" not in comm          # no message sizes: no throughput column
    assert secs["causes"].rows[0]["cost (rank-s)"] == rep["causes"][0]["cost_rank_seconds"]


def test_markdown_in_the_pages_order_with_long_names_cut() -> None:
    md = rv.render_markdown(report())
    order = ["## Verdict", "## Busy time per rank", "## Collective lateness per rank",
             "## Bottleneck ratio per category", "## Slow workers", "## Causes, by cost", "## GPU compute",
             "## Communication, by collective", "## Collective arrivals"]
    pos = [md.index(h) for h in order]
    assert pos == sorted(pos)
    assert "k" * 300 not in md and "k" * 99 + "…" in md
