"""The Job page's queries and their arguments: one home for the page (views/job.py) and for the web
server, which starts the first of them when the browser asks for the page (prefetch.py)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from rankscope.config import Settings
from rankscope.dashboard import queries

HEATMAP_MAX_ROWS = 100     # rank rows of the step-time heatmaps; more ranks are binned

Query = tuple[str, dict[str, Any]]     # (name in rankscope.dashboard.queries, its keyword arguments)


def ranks_args(cfg: Settings, job: str) -> dict[str, Any]:
    """The ranks query of the page (its panel and its profile's rank picker share the result)."""
    return {"job": job, "dead_after_s": cfg.dead_after_s, "slow_min_s": cfg.straggler_min_s,
            "slow_min_steps": cfg.straggler_min_slow_steps}


def world_of(jobs: pd.DataFrame, job: str) -> int:
    """The job's world size in the jobs query's result (0: not known)."""
    world = jobs.loc[jobs["job"] == job, "world_size"] if not jobs.empty else jobs
    return int(world.iloc[0]) if len(world) else 0


def heatmap_args(job: str, world: int) -> dict[str, Any]:
    """The step-time heatmaps' query of a job of ``world`` ranks (above queries.HEATMAP_MIN_RANKS)."""
    return {"job": job, "max_rows": HEATMAP_MAX_ROWS, "ranks": world}


def first_queries(cfg: Settings, job: str, world: int) -> list[Query]:
    """What the page asks first after the jobs query, in its order: the ranks, the alerts and, for
    a large job, the heatmaps."""
    plan: list[Query] = [("ranks", ranks_args(cfg, job)), ("alerts", {"job": job})]
    if world > queries.HEATMAP_MIN_RANKS:
        plan.append(("step_time_heatmaps", heatmap_args(job, world)))
    return plan
