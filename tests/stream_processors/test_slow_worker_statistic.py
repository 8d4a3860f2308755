"""The live slow-rank rule, stage one's busy_z and the diagnosis report judge slow workers by one
statistic (stream_processors/analysis/outliers.py): on the same busy times they name the same ranks
with the same z."""

from __future__ import annotations

import pandas as pd
import pytest

from rankscope.config import Settings
from rankscope.stream_processors.analysis.report import build_report
from rankscope.stream_processors.shard import busy_z_scores
from rankscope.stream_processors.slow_rule import slow_ranks

WINDOW_NS = 100_000_000    # short enough that the report's floor (excess >= 1% of the window) never decides

# 4 ranks, rank 1 at 4x and rank 3 at 2x the others: each is judged against its peers, not against
# a spread its own value widens.
BUSY_NS = {0: 4_200_000, 1: 16_500_000, 2: 4_200_000, 3: 8_100_000}


def summaries(busy: dict[int, int]) -> pd.DataFrame:
    """One kernel per rank whose exclusive time is the rank's busy time."""
    return pd.DataFrame([{"rank": r, "category": "kernel", "name": "gemm", "count": 10, "total_ns": b,
                          "exclusive_ns": b, "median_ns": b // 10, "max_ns": b // 10, "window_ns": WINDOW_NS}
                         for r, b in busy.items()])


@pytest.mark.parametrize(("busy", "slow"), [
    (BUSY_NS, [1, 3]),
    ({r: 60_000_000 + 1_000_000 * (r % 3) for r in range(8)} | {5: 90_000_000}, [5]),
    ({r: 50_000_000 for r in range(6)}, []),
])
def test_the_live_rule_and_the_report_name_the_same_slow_ranks(busy, slow):
    s = Settings()
    live = slow_ranks({r: float(b) for r, b in busy.items()}, s.straggler_z, s.straggler_min_rel)
    report = build_report(summaries(busy), z_threshold=s.straggler_z, min_rel_excess=s.straggler_min_rel)
    assert sorted(r for r, (_, flagged) in live.items() if flagged) == slow
    assert [w["rank"] for w in report["slow_workers"]] == slow
    assert {w["rank"]: w["z"] for w in report["slow_workers"]} == {r: round(live[r][0], 2) for r in slow}
    assert busy_z_scores(busy) == pytest.approx({r: z for r, (z, _) in live.items()})
