"""Where a planned trace window starts: one step for every rank of a job (shared by ``rankscope
trace`` and the processors' automatic windows). Ranks start at the boundary before that step
(producers/trace_window.py); a start by wall-clock time alone races between ranks whose step
boundaries straddle it.
"""

from __future__ import annotations

from typing import Any

START_LEAD_NS = 3_000_000_000   # planned windows start this far ahead, so that every rank has the request


def plan_start_step(rows: list[dict[str, Any]], now_ns: int, lead_ns: int, margin_steps: int = 2) -> int:
    """The step every rank should start a window at, from each rank's latest ``step``, the wall time
    ``ts_ns`` it was seen and its ``median_step_ns``: the furthest rank extrapolated to ``lead_ns``
    from now, plus ``margin_steps``; 0 (start by time) when a row lacks a step or a step time."""
    best = 0
    for r in rows:
        step, ts, median = r.get("step"), r.get("ts_ns"), r.get("median_step_ns")
        if not (isinstance(step, int) and step >= 0 and isinstance(ts, int) and isinstance(median, int) and median > 0):
            return 0
        ahead = max(0, now_ns + lead_ns - ts) // median
        best = max(best, step + 1 + ahead + margin_steps)
    return best
