"""The slow-rank evidence shared by the processors and the dashboard (rankscope/last_arrivals.py)."""

from __future__ import annotations

from rankscope.last_arrivals import enter_share, latest_horizon, slow_watch, steps_from_records

MS = 1_000_000


def records(n_steps: int, n_ranks: int, last_of, lead_ms: float = 2.0, step_ms: int = 100):
    """Step records where ``last_of(step)`` arrives last by ``lead_ms``, the others together."""
    out = []
    for s in range(n_steps):
        start = s * step_ms * MS
        for r in range(n_ranks):
            arrival = start + 50 * MS + (int(lead_ms * MS) if r == last_of(s) else r * 1000)
            out.append((r, s, start, start + step_ms * MS, start + step_ms * MS - arrival))
    return out


def test_the_last_arrival_and_its_lead_make_each_step():
    steps = steps_from_records(records(3, 4, lambda s: 2), 4)
    assert [(st.step, st.rank) for st in steps] == [(0, 2), (1, 2), (2, 2)]
    assert steps[0].saving_ns == 2 * MS - 3000 and steps[0].dur_ns == 100 * MS
    assert steps_from_records(records(3, 4, lambda s: 2)[:-1], 4)[-1].step == 1   # step 2 incomplete


def test_a_rank_last_at_most_steps_is_slow_whatever_it_costs():
    steps = steps_from_records(records(300, 4, lambda s: 1 if s % 5 < 3 else s % 4, lead_ms=0.5), 4)
    watch = slow_watch(steps, 4, min_s=10, min_steps=20)
    assert list(watch) == [1] and watch[1][0] >= enter_share(4) and watch[1][1] < 0.01


def test_turns_taken_by_every_rank_are_no_straggler():
    steps = steps_from_records(records(300, 4, lambda s: s % 4), 4)
    assert slow_watch(steps, 4, min_s=10, min_steps=20) == {}


def test_the_horizon_spans_seconds_and_steps():
    steps = steps_from_records(records(300, 4, lambda s: 0), 4)
    h = latest_horizon(steps, min_s=10, min_steps=20)
    assert len(h) == 101 and h[-1].step == 299          # 10 s of 100 ms steps
    assert latest_horizon(steps[:50], min_s=10, min_steps=20) == []
    assert slow_watch(steps_from_records(records(300, 2, lambda s: 0), 2), 2, 10, 20) == {}  # < 3 ranks
