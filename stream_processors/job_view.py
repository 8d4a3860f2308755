"""The job as its shards last reported it: the shard summaries of one job merged into one view."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rankscope.stream_processors.rank_state import EXTRAPOLATION_CAP_S
from rankscope.stream_processors.shard_summary import Failure, Row, ShardSummary, StackInfo, hist_add

MAX_GROUP_RANKS = 32


@dataclass
class JobView:
    """The job as its shards last reported it: rows of the ranks a rule may name, and totals."""

    rows: dict[int, Row]
    stacks: dict[str, StackInfo]
    exact: bool                 # every rank of the job has a row
    ranks: int
    live: int
    world_size: int
    min_step: int
    newest_hb_s: float
    min_age_s: float            # youngest progress age of a live rank, -1 when none
    step_hist: dict[int, int]
    busy_hist: dict[int, int]
    max_progress: list[dict[str, Any]]
    failures: list[Failure]     # every shard's first failures, first to fail first
    # Per rank with a row: the send time up to which its shard's partition had been read (the
    # shard's ``frontier_ns``), inf when that shard was caught up.
    frontier_s: dict[int, float] = field(default_factory=dict)

    @classmethod
    def merge(cls, summaries: list[ShardSummary], now_s: float) -> JobView:
        rows: dict[int, Row] = {}
        stacks: dict[str, StackInfo] = {}
        step_hist: dict[int, int] = {}
        busy_hist: dict[int, int] = {}
        exact = True
        ranks = live = world = 0
        min_step, newest, min_age = -1, 0.0, -1.0
        progress = []
        failures: dict[int, Failure] = {}
        frontier: dict[int, float] = {}
        for s in summaries:
            for f in s.failures:
                old = failures.get(f.rank)
                if old is None or f.exit_ns > old.exit_ns:
                    failures[f.rank] = f
            a = s.agg
            # A shard read up to its summary time was caught up: its ranks are judged at the rules' now.
            read_to_ns = a.get("frontier_ns", s.ts_ns)
            shard_frontier_s = math.inf if read_to_ns >= s.ts_ns else read_to_ns / 1e9
            for r in s.rows:
                old = rows.get(r.rank)
                if old is None or r.hb_ns > old.hb_ns:   # a rank that moved shard (rolling upgrade): freshest
                    rows[r.rank] = r
                    frontier[r.rank] = shard_frontier_s
            for sig, info in s.stacks.items():
                cur = stacks.get(sig)
                if cur is None:
                    stacks[sig] = StackInfo(info.count, info.waiting, info.frames, list(info.sample))
                else:
                    cur.count += info.count
                    cur.sample = sorted(set(cur.sample) | set(info.sample))[:MAX_GROUP_RANKS]
            exact = exact and len(s.rows) == a["ranks"]
            ranks += a["ranks"]
            live += a["live"]
            world = max(world, a["world_size"])
            if a["live"] and a["min_step"] >= 0:
                min_step = a["min_step"] if min_step < 0 else min(min_step, a["min_step"])
            newest = max(newest, a["newest_hb_ns"] / 1e9)
            if a["min_age_s"] >= 0:
                age = a["min_age_s"] + min(max(0.0, now_s - s.ts_ns / 1e9), EXTRAPOLATION_CAP_S)
                min_age = age if min_age < 0 else min(min_age, age)
            hist_add(step_hist, a["step_hist"])
            hist_add(busy_hist, a["busy_hist"])
            if a["max_step"] >= 0:
                progress.append({"rank": -1, "step": a["max_step"], "ts_ns": a["max_step_end_ns"],
                                 "median_step_ns": a["max_step_med_ns"]})
        return cls(rows=rows, stacks=stacks, exact=exact, ranks=ranks, live=live, world_size=world,
                   min_step=min_step, newest_hb_s=newest, min_age_s=min_age, step_hist=step_hist,
                   busy_hist=busy_hist, max_progress=progress,
                   failures=sorted(failures.values(), key=lambda f: (f.exit_ns, f.rank)), frontier_s=frontier)

    def age(self, r: Row, now_s: float) -> float:
        return r.progress_age_s(now_s, EXTRAPOLATION_CAP_S)
