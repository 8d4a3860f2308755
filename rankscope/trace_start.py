"""Where a planned trace window starts: one step for every rank of a job (shared by ``rankscope
trace`` and the processors' automatic windows). Ranks start at the boundary before that step
(producers/trace_window.py); a start by wall-clock time alone races between ranks whose step
boundaries straddle it. For the same reason a periodic schedule by time (``--every 10m``) becomes a
period in steps at the job's current step time (:func:`steps_per_period`): every rank then opens
its later windows at the same steps too.
"""

from __future__ import annotations

from typing import Any

START_LEAD_NS = 3_000_000_000   # planned windows start this far ahead, so that every rank has the request
FASTER_THAN_MEDIAN = 1.5        # extrapolate as if steps ran this much faster than their median


def plan_start_step(rows: list[dict[str, Any]], now_ns: int, lead_ns: int, margin_steps: int = 2,
                    faster: float = FASTER_THAN_MEDIAN) -> int:
    """The step every rank should start a window at, from each rank's latest ``step``, when it ended
    (``step_end_ns``; else ``ts_ns``, when it was seen, which is later) and its ``median_step_ns``:
    the furthest rank extrapolated to ``lead_ns`` from now, plus ``margin_steps``; 0 (start by time)
    when a row lacks a step or a step time.

    The extrapolation assumes steps ``faster`` times quicker than the median, because a median
    that still holds the slow first steps, or stats some seconds old, undercount the steps run
    since: a rank that gets the request after the planned step has passed starts late and alone,
    while a plan a little too far ahead only delays every rank alike."""
    best = 0
    for r in rows:
        step, median = r.get("step"), r.get("median_step_ns")
        ts = r.get("step_end_ns") or r.get("ts_ns")
        if not (isinstance(step, int) and step >= 0 and isinstance(ts, int) and isinstance(median, int) and median > 0):
            return 0
        ahead = int(max(0, now_ns + lead_ns - ts) * faster) // median
        best = max(best, step + 1 + ahead + margin_steps)
    return best


def steps_per_period(rows: list[dict[str, Any]], every_s: float, window_steps: int) -> int:
    """A period of ``every_s`` seconds in steps at the job's step time (the median of its ranks'
    ``median_step_ns``), at least ``window_steps``; 0 when no rank has a step time yet."""
    times = sorted(r["median_step_ns"] for r in rows
                   if isinstance(r.get("median_step_ns"), int) and r["median_step_ns"] > 0)
    if not times or every_s <= 0:
        return 0
    step_ns = times[len(times) // 2]
    return max(window_steps, round(every_s * 1e9 / step_ns))
