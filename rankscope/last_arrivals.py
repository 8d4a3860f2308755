"""Who arrived last at each step's collective, and what it cost: the slow-rank evidence.

One home for what the processors' slow-rank rule (stream_processors/slow_rule.py, over the steps
its shards merge) and the dashboard (over the steps the store holds) both judge. A rank's arrival at
a step is the end of its step minus the time it was blocked in collectives (``end_ns - comm_ns``);
the last arrival holds every rank back by its lead over the second-to-last. Over a *horizon* (the
newest steps spanning at least ``min_s`` seconds and ``min_steps`` steps) each rank has a last
share (the share of steps it arrived last) and a cost share (its leads over the steps' time). A
rank whose last share reaches :func:`enter_share` is slow, whatever it costs; the processors alert
only the costly ones (``straggler_cost_gate``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

ENTER_SHARE = 0.45          # last at this share of the horizon's steps: slow


class Step(NamedTuple):
    """One complete step of the job: its last rank, that rank's lead over the second, the step time."""

    step: int
    rank: int
    saving_ns: int       # last arrival minus the second-to-last
    dur_ns: int          # the last rank's step time
    arrival_ns: int      # when the last rank arrived (event time)


def enter_share(n_ranks: int) -> float:
    """The last share that makes a rank slow in a job of ``n_ranks`` (fair share is 1/n)."""
    return max(ENTER_SHARE, 1.5 / max(n_ranks, 1))


def horizon_stats(horizon: Sequence[Step]) -> dict[int, tuple[float, float]]:
    """``(last share, cost share)`` of every rank that arrived last at a step of ``horizon``
    (a step whose last two arrivals tie counts for no one)."""
    total_ns = sum(s.dur_ns for s in horizon)
    count: dict[int, int] = {}
    lead: dict[int, int] = {}
    for s in horizon:
        if s.saving_ns <= 0:
            continue
        count[s.rank] = count.get(s.rank, 0) + 1
        lead[s.rank] = lead.get(s.rank, 0) + s.saving_ns
    return {r: (c / len(horizon), lead[r] / total_ns if total_ns > 0 else 0.0) for r, c in count.items()}


def latest_horizon(steps: Sequence[Step], min_s: float, min_steps: int) -> list[Step]:
    """The newest of ``steps`` (oldest first) that span at least ``min_s`` seconds and ``min_steps``
    steps; empty while there are fewer."""
    if len(steps) < max(2, min_steps):
        return []
    newest = steps[-1].arrival_ns
    out: list[Step] = []
    for st in reversed(steps):
        out.append(st)
        if len(out) >= min_steps and newest - st.arrival_ns >= min_s * 1e9:
            out.reverse()
            return out
    return []


def steps_from_records(records: Iterable[tuple[int, int, int, int, int]], n_ranks: int) -> list[Step]:
    """Complete steps, oldest first, from step records ``(rank, step, start_ns, end_ns, comm_ns)``:
    a step counts once ``n_ranks`` ranks recorded it."""
    by_step: dict[int, list[tuple[int, int, int]]] = {}
    for rank, step, start, end, comm in records:
        by_step.setdefault(int(step), []).append((int(end) - max(0, int(comm)), int(rank), max(0, int(end) - int(start))))
    out = []
    for s in sorted(by_step):
        arrivals = sorted(by_step[s], reverse=True)
        if len(arrivals) < max(2, n_ranks):
            continue
        (a, r, dur), second = arrivals[0], arrivals[1][0]
        out.append(Step(s, r, max(0, a - second), dur, a))
    return out


def slow_watch(steps: Sequence[Step], n_ranks: int, min_s: float, min_steps: int) -> dict[int, tuple[float, float]]:
    """The ranks slow over the latest horizon of ``steps``: rank -> (last share, cost share)."""
    horizon = latest_horizon(steps, min_s, min_steps)
    if not horizon or n_ranks < 3:
        return {}
    return {r: v for r, v in horizon_stats(horizon).items() if v[0] >= enter_share(n_ranks)}
